"""The LLM engine: GGUF models on NumPy or native C kernels (CPU) or CuPy (CUDA). Usable without
the supervisor.

    from engine import load_model, SamplingParams
    model = load_model(path, backend="auto")
    ids = model.tokenizer.encode(model.render_chat([{"role": "user", "content": "Hi"}]), parse_special=True)
    async for tok in model.generate(ids, SamplingParams(temperature=0)): print(tok.text, end="")
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from .chat_template import probe_chat_template
from .chat_template import render_chat as _render_chat
from .constrain import Constrainer, Constraint, Grammar
from .decode_chain import DecodeChain
from .errors import ContextOverflowError, EngineError, GrammarError, ModelFormatError, TemplateError
from .gate import Gate, OpenGate
from .generate import Generation, GenerationStats, TokenEvent
from .gguf_file import GGUFFile, GGUFIndex, read_gguf
from .kv_cache import KVCache, KVSnapshot, check_kv_dtype, kv_bytes
from .lock import PriorityLock
from .model import MemoryPlan, Pass, Transformer, plan_memory
from .options import DEFAULT_OPTIONS, EngineOptions
from .sampler import Sampler, SamplingParams
from .spec import ModelSpec, read_spec
from .tokenizer import StreamDecoder, Tokenizer
from .tool_calls import ToolSyntax, tool_syntax

if TYPE_CHECKING:
    from .prompt_cache import ModelCache

__all__ = [
    "Constrainer",
    "Constraint",
    "ContextOverflowError",
    "EngineError",
    "EngineOptions",
    "Gate",
    "Generation",
    "GenerationStats",
    "Grammar",
    "GrammarError",
    "MemoryPlan",
    "Model",
    "ModelFormatError",
    "ModelInfo",
    "OpenGate",
    "Sampler",
    "SamplingParams",
    "StreamDecoder",
    "TemplateError",
    "TokenEvent",
    "Tokenizer",
    "load_model",
    "open_model_file",
]

T = TypeVar("T")
DEFAULT_CTX = 4096
LOGITS_CHUNK = 512  # llama.cpp's default micro-batch (n_ubatch)
PIN_MAX_BYTES = 64 << 20
"""Largest pinned prefix copy (`Model.pin_prefix`): ~400 positions of a 4B model's f16 K/V,
~2,800 of SmolLM2's."""


class _Laps:
    """Records the seconds since the previous call under each name (`Model.load_phases`)."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = round(now - self.t, 4)
        self.t = now


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is and what it holds in memory."""

    name: str
    arch: str
    backend: str
    n_ctx: int
    n_vocab: int
    weights_bytes: int
    kv_bytes: int
    path: str


class Model:
    """A loaded model: tokenizer, chat template, logits and async generation (one at a time)."""

    def __init__(
        self,
        gf: GGUFFile,
        backend: str,
        n_ctx: int,
        kv_dtype: str,
        threads: int | None = None,
        options: EngineOptions | None = None,
        tokenizer: Tokenizer | Callable[[], Tokenizer] | None = None,
    ) -> None:
        opts = options or DEFAULT_OPTIONS
        self.options = opts
        """The tuning knobs the backend was built with (`EngineOptions`)."""
        self.load_phases: dict[str, float] = {}
        """Seconds each step of this load took (tokenizer, template, ops, weights, decoder), in order."""
        lap = _Laps(self.load_phases)
        self.path = gf.path
        self.gguf_index = GGUFIndex.of(gf)
        """Where the file's metadata records and tensors lie (the prompt cache's key hashes them)."""
        self.spec: ModelSpec = read_spec(gf)
        self.tokenizer: Tokenizer
        self.chat_template: str | None
        later = tokenizer if tokenizer is not None and not isinstance(tokenizer, Tokenizer) else None
        if later is None:  # else a function: the tokenizer is being built meanwhile
            self._text(gf, tokenizer if isinstance(tokenizer, Tokenizer) else None, lap)
        self.memory_plan: MemoryPlan = plan_memory(
            gf,
            self.spec,
            n_ctx,
            kv_dtype,
            quantized=backend == "native",
            backend=backend,
            options=opts,
        )
        if backend == "cupy":
            from .backends.cupy_backend import CupyOps

            ops: Any = CupyOps(options=opts)
        elif backend == "native":
            from .backends.cpu_native_ops import NativeOps

            ops = NativeOps(threads=threads, options=opts)
        else:
            from .backends.numpy_backend import NumpyOps

            ops = NumpyOps()
        lap("ops")
        self.backend = ops.name
        self.transformer = Transformer(gf, self.spec, ops, n_ctx, kv_dtype)
        lap("weights_kv")
        self.decoder: Any = ops.make_decoder(self.transformer)
        """Optional backend fast path for one-token steps (e.g. a replayed CUDA graph)."""
        lap("decoder")
        if later is not None:  # being built meanwhile (the prewarm's reader thread): joined last
            self._text(gf, later(), lap)
        self.lock = PriorityLock()
        """Held by a generation for its whole length: the KV cache holds one sequence."""
        self._thread_lock = threading.Lock()
        self._pinned: KVSnapshot | None = None
        self._constrainer: Constrainer | None = None
        self._constrainer_lock = threading.Lock()
        self.info = ModelInfo(
            name=self.spec.name,
            arch=self.spec.arch,
            backend=self.backend,
            n_ctx=n_ctx,
            n_vocab=self.spec.n_vocab,
            weights_bytes=self.transformer.weights_bytes,
            kv_bytes=self.transformer.kv.nbytes,
            path=self.path,
        )

    def _text(self, gf: GGUFFile, tokenizer: Tokenizer | None, lap: _Laps) -> None:
        """The tokenizer (`tokenizer`, else built from `gf`) and the chat template (probed)."""
        self.tokenizer = tokenizer if tokenizer is not None else Tokenizer.from_gguf(gf)
        lap("tokenizer")
        self.chat_template = gf.get("tokenizer.chat_template")
        if self.chat_template is not None:  # untrusted: refuse one that cannot render a small chat
            bos, eos = self._bos_eos_text()
            probe_chat_template(self.chat_template, path=self.path, bos_token=bos, eos_token=eos)
        lap("template")

    # --- text ---------------------------------------------------------------------------
    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as prompt text, through the model's own template (sandboxed); `tools` as
        `engine.chat_template.render_chat` takes them."""
        bos, eos = self._bos_eos_text()
        return _render_chat(
            self.chat_template,
            list(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            arch=self.spec.arch,
        )

    @property
    def tool_syntax(self) -> ToolSyntax:
        """How this model writes tool calls (from its template's markers and architecture)."""
        return tool_syntax(self.chat_template, self.spec.arch)

    def _bos_eos_text(self) -> tuple[str, str]:
        tok = self.tokenizer
        bos = tok.decode([tok.bos_id]) if tok.bos_id is not None else ""
        eos = tok.decode([tok.eos_id]) if tok.eos_id is not None else ""
        return bos, eos

    def encode_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render and tokenize a conversation (special tokens parsed, BOS as the model wants)."""
        text = self.render_chat(messages, tools=tools)
        ids = self.tokenizer.encode(text, add_special=True, parse_special=True)
        bos = self.tokenizer.bos_id
        if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]  # the template already wrote BOS
        return ids

    @property
    def constrainer(self) -> Constrainer:
        """Grammars checked and started against this model's vocabulary (`engine.constrain`);
        made on first use, its llguidance vocabulary built on the first `check`/`start`
        (about a second for 262k tokens: call it off the event loop)."""
        with self._constrainer_lock:
            if self._constrainer is None:
                self._constrainer = Constrainer(self.tokenizer, self.spec.n_vocab)
            return self._constrainer

    # --- compute ------------------------------------------------------------------------
    def logits(self, ids: Sequence[int], last_n: int | None = None) -> np.ndarray:
        """Logits [len(ids), vocab] (or the last `last_n` rows) for `ids` in a fresh context.

        Evaluated as llama.cpp evaluates a generation: the ids up to the first wanted row as a
        prompt, in batches of LOGITS_CHUNK (its default micro-batch), then, on a backend whose
        rounding depends on the batch (`ops.batch_dependent`: the native CPU kernels, which
        round Q4_K like llama.cpp's repacked kernels), the rest one position at a time.
        """
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("ids is empty")
        if len(ids) > self.transformer.n_ctx:
            raise ContextOverflowError(len(ids), self.transformer.n_ctx)
        want = len(ids) if last_n is None else min(last_n, len(ids))
        split = len(ids)
        if want < len(ids) and self.transformer.ops.batch_dependent:
            split = len(ids) - want + 1
        bounds = [(s, min(s + LOGITS_CHUNK, split)) for s in range(0, split, LOGITS_CHUNK)]
        bounds += [(s, s + 1) for s in range(split, len(ids))]
        rows: list[np.ndarray] = []
        with self._thread_lock:
            self.transformer.kv.tokens = []
            for start, end in bounds:
                chunk = ids[start:end]
                n = max(0, min(len(chunk), want - (len(ids) - end)))
                out = self.transformer.forward(chunk, start, last_n=n if n else 1)
                if n:
                    rows.append(np.asarray(self.transformer.ops.to_host(out), dtype=np.float32))
                self.transformer.kv.tokens.extend(chunk)
        return np.concatenate(rows, axis=0)

    def step_logits(self, ids: Sequence[int], pos: int) -> np.ndarray:
        """Run `ids` at `pos` (cache must hold exactly `pos` tokens); logits of the last one."""
        with self._thread_lock:
            tf = self.transformer
            del tf.kv.tokens[pos:]
            if len(ids) == 1 and self.decoder is not None:
                out = self.decoder.logits(int(ids[0]), pos)
            else:
                out = tf.ops.to_host(tf.forward(list(ids), pos, last_n=1))[0]
            tf.kv.tokens.extend(int(t) for t in ids)
            return np.asarray(out, dtype=np.float32)

    def prefill_pass(self, ids: Sequence[int], pos: int, n_layers: int) -> Pass | None:
        """Start prefilling `ids` at `pos` in pieces (cache must hold exactly `pos` tokens): the
        embedding and the first `n_layers` layers, finished on the device when this returns;
        continue with `prefill_layers`. None where the backend replays this chunk as one graph
        (`ops.prefill_graphs`, small models: a few ms): run it whole with `step_logits`."""
        with self._thread_lock:
            tf = self.transformer
            graphs = tf.ops.prefill_graphs
            if graphs is not None and graphs.bucket_for(len(ids), pos, 1, tf.n_ctx, grouped=True) is not None:
                return None
            del tf.kv.tokens[pos:]
            p = tf.begin_replay(list(ids), pos, n_layers) or tf.begin(list(ids), pos, last_n=1)
            p.tokens = [int(t) for t in ids]
        self.prefill_layers(p, n_layers)
        return p

    def prefill_layers(self, p: Pass, n_layers: int) -> np.ndarray | None:
        """The pass's next `n_layers` layers; once the last layer ran, its logits (the chunk's K/V
        now in the cache). On a device backend this piece stays queued when it returns (the piece
        before it has finished), so the device never idles between two pieces while the host
        checks the gate; `prefill_settle` waits for it (before parking: a parked pass leaves
        nothing queued). A backend without events finishes the piece before returning."""
        with self._thread_lock:
            tf = self.transformer
            tf.run_layers(p, p.layer, p.layer + max(1, n_layers))
            if p.layer < len(tf.layers):
                event = tf.ops.mark()
                if event is not None:
                    ahead, p.queued = p.queued, event
                    if ahead is not None:
                        ahead.synchronize()
                else:
                    tf.ops.synchronize()
                return None
            p.queued = None
            out = tf.ops.to_host(tf.end(p))[0]
            tf.kv.tokens.extend(p.tokens)
            return np.asarray(out, dtype=np.float32)

    def prefill_settle(self, p: Pass) -> None:
        """Wait until the pass's queued piece has finished on the device (nothing stays queued)."""
        with self._thread_lock:
            queued, p.queued = p.queued, None
            if queued is not None:
                queued.synchronize()

    def pin_prefix(self, ids: Sequence[int], max_bytes: int = PIN_MAX_BYTES) -> int:
        """Keep a copy of the cached K/V of `ids`' leading tokens (as many as fit `max_bytes`) so
        that a later generation with the same prefix gets it back after other prompts overwrote
        the cache (`restore_pinned`); replaces the previous copy. Returns the tokens kept."""
        with self._thread_lock:
            kv = self.transformer.kv
            n = min(kv.common_prefix(list(ids)), len(ids), max_bytes // max(1, kv.token_bytes()))
            if n <= 0:
                return 0
            if self._pinned is None or self._pinned.tokens != tuple(kv.tokens[:n]):
                self._pinned = kv.snapshot(n)
            self._expect_chunk_at(n)
            return n

    def expect_chunk_at(self, n: int) -> None:
        """Prefill chunks will begin at `n` (a stable prefix of `n` tokens was restored or pinned:
        questions begin where it ends); a backend with later-chunk graphs (CuPy) captures that
        start's at its first chunk instead of its second."""
        with self._thread_lock:
            self._expect_chunk_at(n)

    def _expect_chunk_at(self, n: int) -> None:
        graphs = self.transformer.ops.prefill_graphs
        if graphs is not None:
            graphs.expect(n)

    def with_kv(self, fn: Callable[[KVCache], T]) -> T:
        """`fn(kv_cache)` under the model's thread lock: no forward pass runs meanwhile."""
        with self._thread_lock:
            return fn(self.transformer.kv)

    def restore_pinned(self, ids: Sequence[int]) -> int:
        """Put the pinned prefix back into the cache when it holds more of `ids`' leading tokens
        than the cache does (a copy instead of a prefill); returns the tokens the cache now shares."""
        with self._thread_lock:
            kv, snap = self.transformer.kv, self._pinned
            seq = list(ids)
            have = kv.common_prefix(seq)
            if snap is not None and snap.common_prefix(seq) > have:
                kv.restore(snap)
                have = kv.common_prefix(seq)
            return have

    def step_sample(
        self,
        token: int,
        pos: int,
        sampler: Sampler,
        history: Sequence[int],
        mask: Constraint | None = None,
    ) -> int:
        """One decode step: feed `token` at `pos`, sample the next one (on the device when the
        backend's decoder can: its argmax for plain greedy, its sampler otherwise - the same
        uniform draw from `sampler` as the host path, so a seed gives the same tokens).

        `mask`: the generation's constraint; its mask of allowed next tokens is filled after
        the step's forward pass is queued (on a device: while it runs) and applied before
        sampling. With a logit bias or a mask the logits row comes back to the host unless the
        decoder's sampler takes them (`takes_mask`: the CuPy decoder's does)."""
        p = sampler.params
        dec = self.decoder
        greedy = p.temperature <= 0 and p.repeat_penalty == 1.0
        plain = not p.logit_bias and mask is None
        on_device = plain and (greedy or hasattr(dec, "sample")) or getattr(dec, "takes_mask", False)
        if dec is not None and on_device:
            u = sampler.uniform() if p.temperature > 0 else 0.0
            with self._thread_lock:
                del self.transformer.kv.tokens[pos:]
                if greedy and plain:
                    nxt = int(dec.greedy(int(token), pos))
                elif plain:
                    nxt = int(dec.sample(int(token), pos, p, u, history))
                else:
                    nxt = int(dec.sample(int(token), pos, p, u, history, mask))
                self.transformer.kv.tokens.append(int(token))
                return nxt
        if mask is None:
            return sampler(self.step_logits([token], pos), history)
        pending = mask.fill_async(mask.mask)  # the mask is computed while the forward pass runs
        try:
            logits = self.step_logits([token], pos)
        finally:
            pending.result()
        return sampler(logits, history, mask.mask)

    def decode_chain(self, sampler: Sampler, history: Sequence[int]) -> DecodeChain | None:
        """Decode steps chained on the device for a generation sampling with `sampler` whose ids
        so far are `history` (`engine.decode_chain`): None where the backend's decoder cannot
        chain (no `chain`, or it declines: an untied embedding on the host), the options turn it
        off (`cupy_device_loop`), or the sampling needs the host each step (log-probabilities;
        a constraint is the generation's to exclude)."""
        make = getattr(self.decoder, "chain", None)
        p = sampler.params
        if make is None or not self.options.cupy_device_loop or p.logprobs is not None or p.repeat_last_n < 0:
            return None
        device = make(p)
        if device is None:
            return None
        return DecodeChain(self.transformer, self._thread_lock, sampler, history, device)

    def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        gate: Gate | None = None,
        prefill_chunk: int | None = None,
        priority: int = 0,
        prefill_layer_group: int | None = None,
        pin_prefix: bool = False,
        constraint: Constraint | None = None,
        prompt_cache: ModelCache | None = None,
        save_prefix: int = 0,
    ) -> Generation:
        """An async iterator of TokenEvent; awaits `gate` before every step and prefill chunk
        (and, with `prefill_layer_group` G, between groups of G layers inside a chunk).

        Generations share the model by `priority`: a running one yields to a more urgent one
        between two steps and resumes afterwards (its context rebuilt from the prefix cache).
        With `pin_prefix` the prompt's K/V are copied aside once prefilled (`pin_prefix`), so the
        next generation sharing its prefix copies it back instead of prefilling it again, even if
        other prompts used the cache in between (every generation restores a longer pinned prefix).
        With `constraint` (`model.constrainer.start(grammar)`, one per generation) every token is
        picked from the grammar's mask, and the generation stops ("stop") when the grammar has
        finished; end-of-generation tokens are allowed only where the grammar accepts.
        With `prompt_cache` (this model's `engine.prompt_cache.ModelCache`), a prompt whose prefix a
        cache file holds gets it back from disk, and its first `save_prefix` tokens are offered to
        the cache once prefilled.
        """
        return Generation(
            self,
            prompt_ids,
            sampling or SamplingParams(),
            gate,
            prefill_chunk,
            priority,
            prefill_layer_group,
            pin_prefix,
            constraint,
            prompt_cache,
            save_prefix,
        )

    def close(self) -> None:
        """Drop the weights and the KV cache."""
        self.transformer = None  # type: ignore[assignment]


def open_model_file(path: str | os.PathLike[str], header_only: bool = False) -> GGUFFile:
    """Read a GGUF's header and check that the engine supports it (no weights loaded; the result
    can be passed to `load_model(gguf=)`, unless `header_only`: then no tensor byte is even
    mapped, for planning alone, see `read_gguf`)."""
    gf = read_gguf(path, header_only=header_only)
    read_spec(gf)
    return gf


def load_model(
    path: str | os.PathLike[str],
    backend: str = "auto",
    n_ctx: int | None = None,
    kv_dtype: str = "f16",
    threads: int | None = None,
    options: EngineOptions | None = None,
    gguf: GGUFFile | None = None,
    tokenizer: Tokenizer | Callable[[], Tokenizer] | None = None,
) -> Model:
    """Load a GGUF model. `backend`: "auto" (CuPy when CUDA works, else the native CPU kernels
    when a C compiler builds them, else NumPy), "numpy" (pure NumPy reference), "native", "cupy".
    `threads`: CPU threads of the native kernels (default the options' `threads`, else all cores).
    `options`: the backends' tuning knobs (`engine.options.EngineOptions`; None: read from the
    environment once, here, by `EngineOptions.from_env`).
    `kv_dtype`: KV cache elements, "f16" (the default, as llama.cpp's), "f32" or "int8" (int8
    values + one float16 scale per 32, about 53 % of f16's bytes; see engine.kv_cache).
    `gguf`: the header of `path` already read by `open_model_file` (not read again); `tokenizer`:
    `Tokenizer.from_gguf(gguf)` already built (with `gguf` only), or a function returning it, called
    once the weights are on the device (a tokenizer built in another thread meanwhile)."""
    from .backends import resolve_backend

    opts = options or EngineOptions.from_env()
    if gguf is not None and (gguf.path != os.fspath(path) or not gguf.loadable):
        raise ValueError(f"gguf: a header of {gguf.path}, read header_only={not gguf.loadable}, not one to load {path}")
    if tokenizer is not None and gguf is None:
        raise ValueError("tokenizer: only with the gguf header it was built from")
    t0 = time.perf_counter()
    gf = gguf if gguf is not None else read_gguf(path)
    header_s = time.perf_counter() - t0
    spec = read_spec(gf)
    ctx = int(n_ctx or min(DEFAULT_CTX, spec.n_ctx_train))
    if ctx < 1:
        raise ValueError("n_ctx must be >= 1")
    check_kv_dtype(spec, kv_dtype)
    t1 = time.perf_counter()
    name = resolve_backend(backend, opts)
    resolve_s = time.perf_counter() - t1
    model = Model(gf, name, ctx, kv_dtype, threads, opts, tokenizer)
    model.load_phases = {"header": round(header_s, 4), "backend": round(resolve_s, 4), **model.load_phases}
    return model


# re-exported helpers
__all__ += ["kv_bytes"]
