"""Generation: chunked prefill, then one decode step at a time, each in a worker thread.

The gate is awaited before every prefill chunk and every decode step, so a pause takes effect
before the next forward pass. Cancelling the consumer stops the generation within one step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .errors import ContextOverflowError
from .gate import Gate, OpenGate
from .sampler import Sampler, SamplingParams
from .tokenizer import StreamDecoder

if TYPE_CHECKING:
    from . import Model

DEFAULT_PREFILL_CHUNK = 64


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it completes."""

    id: int
    """Token id."""
    text: str
    """Text this token adds to the output ("" while a UTF-8 character or a possible stop
    string is still incomplete; held text is released with a later token)."""


@dataclass
class GenerationStats:
    """Counts and timings of one generation."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose K/V were reused from the previous request (prefix cache)."""
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
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


class _StopMatcher:
    """Holds back text that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [self.pending.find(s) for s in self.stops]
        found = [h for h in hits if h >= 0]
        if found:
            out = self.pending[: min(found)]
            self.pending = ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generation:
    """An async iterator of TokenEvent with `finish_reason` and `stats` once it ends."""

    def __init__(
        self,
        model: Model,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        gate: Gate | None,
        prefill_chunk: int | None,
    ) -> None:
        self.model = model
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.sampling = sampling
        self.gate: Gate = gate if gate is not None else OpenGate()
        chunk = prefill_chunk or getattr(gate, "prefill_chunk", None) or DEFAULT_PREFILL_CHUNK
        self.prefill_chunk = max(1, int(chunk))
        self.finish_reason: str | None = None
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        self.completion_ids: list[int] = []
        self.text = ""
        self._agen = self._run()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenEvent:
        return await self._agen.__anext__()

    async def aclose(self) -> None:
        await self._agen.aclose()

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
        async with model.lock:
            try:
                cached = min(tf.kv.common_prefix(prompt), len(prompt) - 1)
                tf.kv.tokens = prompt[:cached]
                self.stats.cached_tokens = cached
                if params.max_tokens == 0:
                    self.finish_reason = "length"
                    return
                pos = cached
                logits: Any = None
                while pos < len(prompt):
                    await self.gate.wait("prefill")
                    chunk = prompt[pos : pos + self.prefill_chunk]
                    t0 = time.perf_counter()
                    logits = await anyio.to_thread.run_sync(model.step_logits, chunk, pos)
                    self.stats.prefill_s += time.perf_counter() - t0
                    pos += len(chunk)
                history = list(prompt)
                token = sampler(logits, history)
                hit = False
                while True:
                    if token in eog and not params.ignore_eos:
                        self.finish_reason = "stop"
                        break
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
                            yield TokenEvent(token, text)
                        break
                    yield TokenEvent(token, text)
                    if self.stats.completion_tokens >= params.max_tokens or pos >= tf.n_ctx:
                        self.finish_reason = "length"
                        break
                    await self.gate.wait("decode")
                    t0 = time.perf_counter()
                    token = await anyio.to_thread.run_sync(model.step_sample, token, pos, sampler, history)
                    self.stats.decode_s += time.perf_counter() - t0
                    pos += 1
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
