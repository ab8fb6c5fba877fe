"""Generation: chunked prefill, then one decode step at a time, each in a worker thread.

The gate is awaited before every prefill chunk and every decode step launch, so a pause takes
effect before the next forward pass; with a layer group G (`prefill_layer_group`) also between
groups of G layers inside a chunk, the activations kept on the device while paused. Where the
backend chains decode steps on the device (`Model.decode_chain`, `engine.decode_chain`), one step
stays queued ahead of the token being read, and is waited for before a park or a yield; pieces
and steps are otherwise finished on the device before the host goes on, so a parked generation has
nothing queued. Cancelling the consumer stops the generation within one step; tokens a queued
step made past a stop are dropped.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import numpy as np

from .decode_chain import DecodeChain
from .errors import ContextOverflowError, GrammarError
from .gate import Gate, OpenGate, Phase
from .sampler import Sampler, SamplingParams, log_probs
from .stop_matcher import StopMatcher as _StopMatcher
from .tokenizer import StreamDecoder

if TYPE_CHECKING:
    from . import Model
    from .constrain import Constraint
    from .prompt_cache import ModelCache

DEFAULT_PREFILL_CHUNK = 64
"""Prompt tokens per forward pass when neither the caller, the gate nor the backend's ops
(`ops.prefill_chunk`: CuPy 512) say otherwise; right for CPU, where the gate is awaited between
chunks and a chunk is tens of milliseconds."""


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it completes."""

    id: int
    """Token id."""
    text: str
    """Text this token adds to the output ("" while a UTF-8 character or a possible stop
    string is still incomplete; held text is released with a later token)."""
    logprob: float | None = None
    """With `SamplingParams.logprobs`: the token's log-probability (log-softmax of the biased,
    masked logits at temperature 1); None otherwise and on a tail event (id -1 or a repeat)."""
    top: tuple[tuple[int, float], ...] = ()
    """With `SamplingParams.logprobs` n: the n most likely (id, log-probability), most likely first."""


@dataclass
class GenerationStats:
    """Counts and timings of one generation."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose K/V were reused from the previous request (prefix cache)."""
    disk_tokens: int = 0
    """Of `cached_tokens`, those put back from the disk prompt cache (`engine.prompt_cache`)."""
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    """From the first token to the last, less the time spent at the gate (parked, paced, yielding
    to a more urgent generation) and rebuilding the context after a yield: the decode rate as the
    consumer gets it (its own time between tokens counts too)."""
    first_token_s: float | None = None
    """From the call to the first token (includes waiting for the model and the gate)."""

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        n = max(0, self.completion_tokens - 1)
        return n / self.decode_s if self.decode_s > 0 else 0.0


class TokenIdError(ValueError):
    """A prompt token id outside the vocabulary (negative ones would index from the end)."""

    def __init__(self, name: str, index: int, token: int, n_vocab: int | None) -> None:
        self.param = f"{name}[{index}]"
        """Where it is: ``prompt[3]``."""
        self.token = token
        """The id."""
        self.n_vocab = n_vocab
        """The vocabulary size (None: not known, only a negative id was found)."""
        shown = str(token) if abs(token) < 10**18 else f"{str(token)[:19]}... ({len(str(token))} digits)"
        vocab = f"0..{n_vocab - 1}" if n_vocab is not None else "0..n_vocab-1"
        super().__init__(f"{self.param}: token id {shown} is outside the vocabulary ({vocab})")


def check_prompt_ids(ids: Sequence[int], n_vocab: int | None, name: str = "prompt") -> None:
    """TokenIdError for the first id outside 0..n_vocab-1 (only negative ones when n_vocab is None)."""
    for i, t in enumerate(ids):
        if t < 0 or (n_vocab is not None and t >= n_vocab):
            raise TokenIdError(name, i, t, n_vocab)


class Generation:
    """An async iterator of TokenEvent with `finish_reason` and `stats` once it ends."""

    def __init__(
        self,
        model: Model,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        gate: Gate | None,
        prefill_chunk: int | None,
        priority: int = 0,
        prefill_layer_group: int | None = None,
        pin_prefix: bool = False,
        constraint: Constraint | None = None,
        prompt_cache: ModelCache | None = None,
        save_prefix: int = 0,
    ) -> None:
        self.model = model
        self.prompt_cache = prompt_cache
        """The model's disk prompt cache: restores a prefix before the prefill, takes `save_prefix`."""
        self.save_prefix = max(0, min(int(save_prefix), len(prompt_ids) - 1))
        """Leading prompt tokens offered to the model's disk prompt cache once prefilled (0: none)."""
        self.constraint = constraint
        """The grammar the output must match (`engine.constrain`): its mask is applied before
        every token is picked; the generation stops ("stop") when the grammar has finished."""
        self.pin_prefix = pin_prefix
        """Copy the prompt's K/V aside once prefilled (`Model.pin_prefix`)."""
        self.priority = priority
        """Higher runs first; a running generation yields to a more urgent one between steps."""
        self.preemptions = 0
        """Times this generation yielded the model to a more urgent one."""
        self._running_cm: Any = None
        self._holding = False
        self.prompt_ids = [int(t) for t in prompt_ids]
        check_prompt_ids(self.prompt_ids, model.info.n_vocab)
        bad = [t for t, _ in sampling.logit_bias if t >= model.info.n_vocab]
        if bad:
            raise GrammarError(
                f"token id {bad[0]} is outside the vocabulary (0..{model.info.n_vocab - 1})", param="logit_bias"
            )
        self.sampling = sampling
        self._logprob: tuple[float | None, tuple[tuple[int, float], ...]] = (None, ())
        self.gate: Gate = gate if gate is not None else OpenGate()
        chunk = (
            prefill_chunk
            or getattr(gate, "prefill_chunk", None)
            or model.transformer.ops.prefill_chunk
            or DEFAULT_PREFILL_CHUNK
        )
        self.prefill_chunk = max(1, int(chunk))
        """Prompt tokens per forward pass: the caller's, else the gate's, else the backend's."""
        group = prefill_layer_group if prefill_layer_group is not None else getattr(gate, "prefill_layer_group", None)
        self.prefill_layer_group = max(0, int(group or 0))
        """Layers per prefill piece, the gate awaited between two (0: whole chunks): the caller's,
        else the gate's `prefill_layer_group`. A chunk the backend replays as one CUDA graph
        (`ops.prefill_graphs`) stays one piece."""
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        self.completion_ids: list[int] = []
        self.text = ""
        self._waited = 0.0
        """Seconds spent in checkpoints (the gate, yields), excluded from the decode time."""
        self._agen = self._run()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenEvent:
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        await self._agen.aclose()

    async def _hold(self) -> None:
        """Take the model (by priority) and tell the gate a generation is running on it."""
        await self.model.lock.acquire(self, self.priority)
        self._holding = True
        running = getattr(self.gate, "running", None)
        self._running_cm = running() if running is not None else None
        if self._running_cm is not None:
            self._running_cm.__enter__()

    def _unhold(self) -> None:
        if not self._holding:  # cancelled while queued for the model after yielding it
            return
        if self._running_cm is not None:
            self._running_cm.__exit__(None, None, None)
            self._running_cm = None
        self._holding = False
        self.model.lock.release(self)

    def _would_wait(self, phase: Phase) -> bool:
        """Whether the next checkpoint may not return at once (a more urgent generation waits, or
        the gate's `blocks` says it would park); a gate without that hook always may."""
        if self.model.lock.should_yield(self):
            return True
        blocks = getattr(self.gate, "blocks", None)
        return True if blocks is None else bool(blocks(phase))

    async def _checkpoint(self, phase: Phase) -> None:
        """Between two steps: yield the model to a more urgent generation, then pass the gate. One
        that asks for the model while this one waits at the gate (parked) gets it first."""
        lock = self.model.lock
        t0 = time.perf_counter()
        try:
            while True:
                if lock.should_yield(self):
                    self.preemptions += 1
                    self._unhold()
                    await self._hold()
                with anyio.CancelScope() as scope, lock.on_outranked(self, scope.cancel):
                    await self.gate.wait(phase)
                if not lock.should_yield(self):
                    return
        finally:
            self._waited += time.perf_counter() - t0

    async def _chain_checkpoint(self, chain: DecodeChain) -> None:
        """`_checkpoint` before a chained step's launch: with steps queued, it first waits for them
        (their tokens go to `chain.ready`) when the gate would park or a more urgent generation
        waits, so a parked or yielding generation leaves nothing queued on the device."""
        lock = self.model.lock
        while True:
            if chain.in_flight and self._would_wait("decode"):
                await anyio.to_thread.run_sync(chain.settle)
            if not chain.in_flight:
                await self._checkpoint("decode")
                return
            t0 = time.perf_counter()
            try:  # the gate is open: it returns at once, or paces a throttled decode
                with anyio.CancelScope() as scope, lock.on_outranked(self, scope.cancel):
                    await self.gate.wait("decode")
            finally:
                self._waited += time.perf_counter() - t0
            if not lock.should_yield(self):
                return

    async def _chained(self, chain: DecodeChain, token: int, pos: int, history: list[int]) -> int | None:
        """The token after `token` (fed at `pos`) from steps chained on the device: queue the
        step that makes it (unless queued) and one step ahead (unless the length or the context
        ends first, steps take longer than `decode_chain.AHEAD_MAX_STEP_S`, or the gate may not
        pass at once: one that cannot tell never gets a step ahead), the gate awaited before each
        launch; then read it back. None when the cache no longer holds `history` (another
        generation used it while this one yielded)."""
        if chain.ready:
            return chain.ready.popleft()
        more = self.stats.completion_tokens + 1 < self.sampling.max_tokens and pos + 1 < self.model.transformer.n_ctx
        want = 2 if more and chain.ahead_ok and not self._would_wait("decode") else 1  # ahead: past an open gate
        while True:
            launch = chain.in_flight < want
            if launch:
                await self._chain_checkpoint(chain)
                if chain.ready:
                    return chain.ready.popleft()
                if not chain.in_flight and self.model.transformer.kv.common_prefix(history) < pos:
                    return None
            collect = not launch or chain.in_flight + 1 >= want
            got = await anyio.to_thread.run_sync(chain.step, token, pos, launch, collect)
            if got is not None:
                return got

    async def _stepwise(
        self, token: int, pos: int, sampler: Sampler, history: list[int], constraint: Constraint | None
    ) -> int | None:
        """The token after `token` (fed at `pos`), one step at a time: the gate, then the step;
        None when the cache no longer holds `history` (another generation used it meanwhile)."""
        await self._checkpoint("decode")
        if self.model.transformer.kv.common_prefix(history) < pos:
            return None
        if self.sampling.logprobs is not None:
            return await anyio.to_thread.run_sync(self._step_host, token, pos, sampler, history)
        step = self.model.step_sample
        return await anyio.to_thread.run_sync(step, token, pos, sampler, history, constraint)

    async def _prefill(self, seq: list[int]) -> Any:
        """Make the KV cache hold `seq` (reusing its cached prefix); logits of the last token."""
        tf = self.model.transformer
        logits: Any = None
        while True:
            await self._checkpoint("prefill")
            self.model.restore_pinned(seq)  # a pinned prefix longer than the cached one comes back
            pos = min(tf.kv.common_prefix(seq), len(seq) - 1)  # re-read: a yield may have changed it
            chunk = seq[pos : pos + self.prefill_chunk]
            logits = await self._chunk(chunk, pos)
            if logits is not None and pos + len(chunk) >= len(seq):
                return logits

    async def _chunk(self, chunk: list[int], pos: int) -> Any:
        """One prefill chunk (the gate passed before it): whole, or in layer groups with the gate
        awaited between two; None when it was given up (the model went to a more urgent
        generation between two groups: the caller starts the chunk again from the cache)."""
        model, group = self.model, self.prefill_layer_group
        n_layers = len(model.transformer.layers)
        t0 = time.perf_counter()
        p = None
        if 0 < group < n_layers and len(chunk) > 1:
            p = await anyio.to_thread.run_sync(model.prefill_pass, chunk, pos, group)
        if p is None:
            logits = await anyio.to_thread.run_sync(model.step_logits, chunk, pos)
            self.stats.prefill_s += time.perf_counter() - t0
            return logits
        self.stats.prefill_s += time.perf_counter() - t0
        while True:
            before = self.preemptions
            if p.queued is not None and self._would_wait("prefill"):
                await anyio.to_thread.run_sync(model.prefill_settle, p)  # park with nothing queued
            await self._checkpoint("prefill")
            if self.preemptions != before:
                return None  # another generation wrote the cache meanwhile
            t0 = time.perf_counter()
            out = await anyio.to_thread.run_sync(model.prefill_layers, p, group)
            self.stats.prefill_s += time.perf_counter() - t0
            if out is not None:
                return out

    def _pick(self, sampler: Sampler, logits: np.ndarray, history: list[int]) -> int:
        """The next token from a logits row on the host: the constraint's mask, the bias, the
        chain; its log-probabilities kept for the event when asked for."""
        mask = None
        if self.constraint is not None:
            mask = self.constraint.mask
            self.constraint.fill(mask)
        p = sampler.params
        x = sampler.adjusted(logits, mask)
        u = sampler.uniform() if p.temperature > 0.0 else 0.0
        token = sampler.pick_adjusted(x, u, history, masked=mask is not None)
        if p.logprobs is not None:
            self._logprob = log_probs(x, token, p.logprobs)
        return token

    def _step_host(self, token: int, pos: int, sampler: Sampler, history: list[int]) -> int:
        """One decode step whose logits row comes to the host (log-probabilities asked for)."""
        return self._pick(sampler, self.model.step_logits([token], pos), history)

    async def _first(self, sampler: Sampler, logits: np.ndarray, history: list[int]) -> int:
        """The token after a prefill: on the loop as before, in a worker thread when a mask or
        log-probabilities make it costlier."""
        if self.constraint is None and sampler.params.logprobs is None:
            return sampler(logits, history)
        return await anyio.to_thread.run_sync(self._pick, sampler, logits, history)

    async def _run(self) -> AsyncGenerator[TokenEvent, None]:
        model, tf = self.model, self.model.transformer
        prompt, params = self.prompt_ids, self.sampling
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= tf.n_ctx:
            raise ContextOverflowError(len(prompt) + 1, tf.n_ctx)
        t_call = time.perf_counter()
        sampler = Sampler(params)
        decoder = StreamDecoder(model.tokenizer)
        stopper = _StopMatcher(params.stop)
        eog = model.tokenizer.eog_ids
        constraint = self.constraint
        chain: DecodeChain | None = None
        await self._hold()
        try:
            have = self.model.restore_pinned(prompt)
            disk = self.prompt_cache
            if disk is not None:
                have, self.stats.disk_tokens = await anyio.to_thread.run_sync(
                    disk.restore, prompt, have, self.save_prefix
                )
            self.stats.cached_tokens = min(have, len(prompt) - 1)
            self.stats.disk_tokens = min(self.stats.disk_tokens, self.stats.cached_tokens)
            if params.max_tokens == 0:
                self.finish_reason = "length"
                return
            logits = await self._prefill(prompt)
            if self.pin_prefix:
                self.model.pin_prefix(prompt)
            if disk is not None and self.save_prefix:
                await anyio.to_thread.run_sync(disk.offer, prompt[: self.save_prefix])
            history = list(prompt)
            token = await self._first(sampler, logits, history)
            if constraint is None:  # a grammar's mask needs each token on the host before the next step
                chain = model.decode_chain(sampler, history)
            t_first, waited, rebuild = time.perf_counter(), self._waited, 0.0
            hit = False
            while True:
                if token in eog and not params.ignore_eos:
                    self.finish_reason = "stop"
                    break
                if constraint is not None:
                    constraint.advance(token)
                logprob, top = self._logprob
                self.completion_ids.append(token)
                history.append(token)
                self.stats.completion_tokens += 1
                if self.stats.first_token_s is None:
                    self.stats.first_token_s = time.perf_counter() - t_call
                text, hit = stopper.push(decoder.feed(token))
                self.text += text
                if hit:
                    self.finish_reason = "stop"
                    if text:
                        yield TokenEvent(token, text, logprob, top)
                    break
                yield TokenEvent(token, text, logprob, top)
                if constraint is not None and constraint.done:
                    self.finish_reason = "stop"
                    break
                pos = len(history) - 1
                if self.stats.completion_tokens >= params.max_tokens or pos >= tf.n_ctx:
                    self.finish_reason = "length"
                    break
                if chain is not None:
                    nxt = await self._chained(chain, token, pos, history)
                else:
                    nxt = await self._stepwise(token, pos, sampler, history, constraint)
                if nxt is None:  # another generation used the cache meanwhile: rebuild our context first
                    t0, w0 = time.perf_counter(), self._waited
                    nxt = await self._first(sampler, await self._prefill(history), history)
                    rebuild += time.perf_counter() - t0 - (self._waited - w0)
                token = nxt
                self.stats.decode_s = time.perf_counter() - t_first - (self._waited - waited) - rebuild
            if not hit:  # release what the UTF-8 decoder and the stop matcher still hold
                tail, hit = stopper.push(decoder.flush())
                if not hit:
                    tail += stopper.flush()
                if tail:
                    self.text += tail
                    yield TokenEvent(self.completion_ids[-1] if self.completion_ids else -1, tail)
        finally:
            if self.finish_reason is None:
                self.finish_reason = "cancelled"
            if chain is not None and chain.in_flight:  # a step queued past the last token read
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(chain.settle)
            self._unhold()
