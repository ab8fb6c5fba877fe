"""The daemon's one door to the LLM engine: load off the loop, admit, generate behind the gate.

    host = EngineHost(path, gate=gate, arbiter=arbiter, publish=store.publish)
    await tg.start(host.run)                                  # ready once the model is loaded
    gen = await host.generate(messages, SamplingParams(max_tokens=64), priority="voice")
    async with gen:
        async for tok in gen: ...                             # engine.TokenEvent
    gen.finish_reason, gen.stats                              # "stop" | "length" | "cancelled"

Every generation runs with the DecodeGate (the engine enters ``gate.running()`` while it holds the model) and the policy's prefill
chunk and layer group, so a pause parks it before its next step or piece. Admission follows the
arbiter: ``refuse_new`` refuses new requests, ``max_context`` bounds prompt + max_tokens; both raise
an AdmissionError that says why. The host publishes ``EngineStats`` on every state change and every
``stats_interval_s`` while generating. The queue and the priority classes (admission.py) and the
model roles (models.py) wrap ``generate``; the model runs one generation at a time, a ``voice`` one
preempting a running background one between two steps (``PRIORITY_RANK``, hosted_generation.py).
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import anyio
import anyio.to_thread
import psutil
import structlog
from anyio.abc import TaskStatus

from engine import GrammarError, Model, SamplingParams, load_model, open_model_file
from engine.backends import resolve_backend
from engine.gguf_file import GGUFFile
from engine.model import MemoryPlan, plan_on
from engine.options import EngineOptions
from engine.prompt_cache import ModelCache, PromptCache

from ..arbiter import Arbiter, DecodeGate
from ..errors import AdmissionError as AdmissionError  # re-export
from ..errors import ContextTooLong, EngineUnavailable, RequestRefused
from ..events import EngineStats, Observation
from ..startup import early_header, take_early
from .extras import prepare
from .generation import HostedGeneration as HostedGeneration  # re-export
from .serving import NO_EXTRAS, RequestExtras, plan_parts_mb

log = structlog.get_logger(__name__)


def release_freed_memory() -> None:
    """Collect garbage and give freed heap back to the OS (glibc ``malloc_trim``), after a model unload.

    Without it the worker threads' malloc arenas keep a model's freed scratch: measured, six
    load/unload cycles of SmolLM2 and Gemma 3 left 145-225 MiB resident unloaded, with it 82-115.
    A no-op where the C library has no ``malloc_trim`` (musl, macOS). Objects the start froze
    (`gc_start`: the model loaded at start among them) are unfrozen first, or a model in a
    reference cycle would never be collected.
    """
    gc.unfreeze()
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


MiB = 1024 * 1024
Prompt = Sequence[int] | str | Sequence[Mapping[str, Any]]
"""Token ids, raw text (tokenized as is), or chat messages (rendered with the model's template)."""


class EngineHost:
    """Loads the model in a worker thread, admits requests, runs generations behind the gate."""

    def __init__(
        self,
        model_path: str | os.PathLike[str] | None,
        *,
        gate: DecodeGate,
        arbiter: Arbiter,
        publish: Callable[[Observation], None],
        backend: str = "auto",
        n_ctx: int = 4096,
        kv_dtype: str = "f16",
        threads: int | None = None,
        loader: Callable[..., Model] = load_model,
        stats_interval_s: float = 1.0,
        autoload: bool = True,
        prompt_cache: PromptCache | None = None,
    ) -> None:
        self.model_path = os.fspath(model_path) if model_path is not None else None
        """GGUF file to load, None runs without an LLM."""
        self.gate = gate
        """The decode gate every generation awaits."""
        self.arbiter = arbiter
        """Where admission flags and the prefill chunk come from."""
        self.model: Model | None = None
        """The loaded model."""
        self.memory_plan: MemoryPlan | None = None
        """Planned bytes (weights, KV, scratch) for the policy's prefill chunk, known before the
        weights load; once loaded, the plan the model was loaded with (until it is unloaded)."""
        self.error: str | None = None
        """Why loading failed."""
        self.closing = False
        """Set at shutdown: running generations stop at their next step, new ones are refused."""
        self.stats_interval_s = stats_interval_s
        """How often stats are published while generating."""
        self.load_seconds: float | None = None
        """How long the last load took."""
        self.early = False
        """Whether the model was loaded at process start (`startup.prepare`) and taken over."""
        self.prompt_cache: PromptCache | None = prompt_cache
        """The prompt cache on disk (None: off); the loaded model's part of it is `model_cache`."""
        self.model_cache: ModelCache | None = None
        """The loaded model's prompt cache: attached at load, dropped at unload."""
        self._publish_fn = publish
        self._backend, self._n_ctx, self._kv_dtype = backend, n_ctx, kv_dtype
        self._threads = threads
        self._loader = loader
        self._load_state = "disabled" if self.model_path is None else ("loading" if autoload else "unloaded")
        self._header: GGUFFile | None = None  # the plan's header, handed to the load (read once)
        self._live: list[HostedGeneration] = []
        self._tokens_done = 0
        self._last: HostedGeneration | None = None
        self._activity: anyio.Event | None = None  # events are made on the loop, not here
        self._idle: anyio.Event | None = None
        self._closed: anyio.Event | None = None
        self._proc = psutil.Process()
        arbiter.add_listener(lambda _decision: self._changed())

    # -- state ------------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """``disabled``, ``unloaded``, ``loading``, ``error``, ``idle``, ``prefill``, ``decoding``, ``paused``, ``throttled``."""
        if self._load_state != "ready":
            return self._load_state
        if not self._live:
            return "idle"
        passing = [g for g in self._live if self.gate.mode_for(g.priority)[0] != "paused"]
        if not passing:  # a voice generation passes a pause that protects the voice path
            return "paused"
        if self.gate.mode_for(passing[0].priority)[0] == "throttled":
            return "throttled"
        return "decoding" if any(g.decoding for g in passing) else "prefill"

    @property
    def in_flight(self) -> int:
        """Generations admitted and not finished (one computes, the others wait for the model)."""
        return len(self._live)

    @property
    def backend(self) -> str | None:
        """``numpy`` / ``cupy`` once loaded, else what was asked for."""
        return self.model.backend if self.model is not None else (self._backend if self.model_path else None)

    def stats(self) -> EngineStats:
        """The engine's state as an observation."""
        running = next((g for g in self._live if g.decoding), None)
        ref = running or self._last
        tps = None
        if ref is not None:
            tps = ref.wall_tps() if ref is running else (ref.stats.decode_tps or None)
        first_ms = None
        if ref is not None and ref.stats.first_token_s is not None:
            first_ms = round(ref.stats.first_token_s * 1000.0, 3)
        info = self.model.info if self.model is not None else None
        try:
            rss = self._proc.memory_info().rss / MiB
        except psutil.Error:
            rss = None
        return EngineStats(
            state=self.state,
            model=info.name if info else (os.path.basename(self.model_path) if self.model_path else None),
            backend=self.backend,
            decode_tps=round(tps, 3) if tps else None,
            first_token_ms=first_ms,
            tokens_total=self._tokens_done + sum(g.stats.completion_tokens for g in self._live),
            requests_in_flight=len(self._live),
            weights_mb=round(info.weights_bytes / MiB, 3) if info else None,
            kv_mb=round(info.kv_bytes / MiB, 3) if info else None,
            rss_mb=round(rss, 1) if rss is not None else None,
            scratch_mb=round(self.memory_plan.scratch / MiB, 3) if info and self.memory_plan else None,
            n_ctx=info.n_ctx if info else None,
            kv_dtype=self._kv_dtype if info else None,
        )

    def publish_stats(self) -> None:
        """Publish the current EngineStats now."""
        self._publish_fn(self.stats())

    def _changed(self) -> None:
        self._publish_fn(self.stats())

    def _started(self, g: HostedGeneration) -> None:
        self._live.append(g)
        if self._activity is not None:
            self._activity.set()
        self._changed()

    def _finished(self, g: HostedGeneration) -> None:
        if g in self._live:
            self._live.remove(g)
        self._tokens_done += g.stats.completion_tokens
        self._last = g
        if not self._live and self._idle is not None:
            self._idle.set()
        log.info(
            "generation_done",
            finish=g.finish_reason,
            priority=g.priority,
            prompt_tokens=g.stats.prompt_tokens,
            cached_tokens=g.stats.cached_tokens,
            completion_tokens=g.stats.completion_tokens,
            first_token_ms=round((g.stats.first_token_s or 0) * 1000, 1),
            decode_tps=round(g.stats.decode_tps, 2),
        )
        self._changed()

    # -- lifecycle --------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load the model (raises EngineError), then publish stats while generating."""
        self._changed()
        if self.model_path is not None:
            await self._load(self.model_path)
        task_status.started()
        while True:
            if self._live:
                await anyio.sleep(self.stats_interval_s)
                self._changed()
            else:
                self._activity = anyio.Event()
                await self._activity.wait()

    async def plan(self) -> MemoryPlan:
        """The memory plan of the configured model, read from its GGUF header (no weights loaded):
        prefill scratch for the policy's prefill chunk now (a loaded model: the plan it was loaded
        with; a changed chunk reaches it at its next load)."""
        if self.model_path is None:
            raise EngineUnavailable("no model is configured")
        chunk = self.arbiter.prefill_chunk_tokens
        plan = self.memory_plan
        if self.model is None and (plan is None or plan.chunk != chunk):
            self.memory_plan = await anyio.to_thread.run_sync(self._plan, self.model_path, chunk)
        assert self.memory_plan is not None
        return self.memory_plan

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens per prefill pass for new generations: the policy's, at most the chunk the
        loaded model's scratch was planned for (a larger one applies from the next load)."""
        chunk = self.arbiter.prefill_chunk_tokens
        plan = self.memory_plan
        return min(chunk, plan.chunk) if self.model is not None and plan is not None else chunk

    async def load(self) -> None:
        """Load the configured model now (the model manager calls this; `run` does it at start)."""
        if self.model_path is None:
            raise EngineUnavailable("no model is configured")
        self.closing = False
        self._load_state, self.error = "loading", None
        await self._load(self.model_path)

    def closed_event(self) -> anyio.Event:
        """Set when running generations must stop (an unload or shutdown)."""
        if self._closed is None:
            self._closed = anyio.Event()
            if self.closing:
                self._closed.set()
        return self._closed

    async def unload(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - a bounded drain
        """Stop running generations at their next step (bounded wait), drop the weights and the KV cache."""
        self.closing = True
        self.closed_event().set()
        with anyio.move_on_after(timeout):
            while self._live:
                self._idle = anyio.Event()
                await self._idle.wait()
        self._closed = None
        model, self.model, self.model_cache = self.model, None, None
        close = getattr(model, "close", None)
        if close is not None:
            close()
        del model
        await anyio.to_thread.run_sync(release_freed_memory)
        self._load_state = "unloaded"
        self.closing = False
        self._changed()

    async def _load(self, path: str) -> None:
        t0 = time.monotonic()
        chunk = self.arbiter.prefill_chunk_tokens
        log.info(
            "model_loading",
            path=path,
            backend=self._backend,
            n_ctx=self._n_ctx,
            kv_dtype=self._kv_dtype,
            prefill_chunk=chunk,
        )
        try:
            plan = self.memory_plan
            if plan is None or plan.chunk != chunk or self._header is None:
                plan = await anyio.to_thread.run_sync(self._plan, path, chunk)
            self.memory_plan = plan
            model = await anyio.to_thread.run_sync(self._load_blocking, path, plan.chunk, abandon_on_cancel=True)
        except BaseException as exc:
            self._load_state, self.error = "error", f"{type(exc).__name__}: {exc}"
            self._changed()
            raise
        self.model, self._load_state = model, "ready"
        self.load_seconds = time.monotonic() - t0
        if self.prompt_cache is not None:  # its key and index are made in a background thread
            self.model_cache = self.prompt_cache.attach(model)
        log.info(
            "model_loaded",
            name=model.info.name,
            arch=model.info.arch,
            backend=model.backend,
            n_ctx=model.info.n_ctx,
            weights_mb=round(model.info.weights_bytes / MiB, 1),
            kv_mb=round(model.info.kv_bytes / MiB, 1),
            kv_dtype=self._kv_dtype,
            plan=plan_parts_mb(plan),
            phases_s=getattr(model, "load_phases", None),  # a test's fake model may not say
            early=self.early,
            load_s=round(time.monotonic() - t0, 2),
        )
        self._changed()

    def _options(self, chunk: int) -> EngineOptions:
        return replace(EngineOptions.from_env(), prefill_chunk=chunk)

    def _plan(self, path: str, chunk: int) -> MemoryPlan:
        gf = (early_header(path) if self._loader is load_model else None) or open_model_file(path)
        self._header = gf  # the load takes it instead of reading the header again
        return plan_on(gf, self._n_ctx, self._kv_dtype, resolve_backend(self._backend), self._options(chunk))

    def _load_blocking(self, path: str, chunk: int) -> Model:
        kwargs: dict[str, Any] = {"threads": self._threads} if self._threads else {}
        header, self._header = self._header, None  # held only from the plan to the load
        if self._loader is load_model:  # loaded at process start with these very parameters?
            early = take_early(self._backend, self._options(chunk), path, self._n_ctx, self._kv_dtype, self._threads)
            if early is not None:
                self.early = True
                return cast(Model, early)
        return self._loader(
            path,
            backend=self._backend,
            n_ctx=self._n_ctx,
            kv_dtype=self._kv_dtype,
            options=self._options(chunk),
            gguf=header,
            **kwargs,
        )

    async def shutdown(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - a bounded drain
        """Refuse new requests, stop running generations at their next step, wait (bounded)."""
        self.closing = True
        self.closed_event().set()
        if self._live and self.gate.mode == "paused":
            self.gate.open()  # wake parked generations; the host gate then stops them
        with anyio.move_on_after(timeout):
            while self._live:
                self._idle = anyio.Event()
                await self._idle.wait()
        if self._load_state == "ready":
            self._load_state = "disabled"
        self._changed()

    # -- requests ---------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        priority: str | None = None,
        extras: RequestExtras = NO_EXTRAS,
    ) -> HostedGeneration:
        """Admit a request and return its generation (not started until iterated); `extras`: tools,
        constrained output and biases by string (`llm.extras.prepare`, in a worker thread).

        Raises EngineUnavailable, RequestRefused or ContextTooLong with the reason, GrammarError
        (naming the request field) for a grammar or tool schema the model's vocabulary cannot take.
        """
        sampling = sampling or SamplingParams()
        model = self._admit()
        prepared = None
        if extras.empty:
            ids = await self._tokenize(model, prompt)
        else:
            prepared = await anyio.to_thread.run_sync(prepare, model, prompt, sampling, extras)
            ids, sampling = prepared.ids, prepared.sampling
        if not ids:
            raise ValueError("the prompt is empty")
        outside = [t for t, _ in sampling.logit_bias if t >= model.info.n_vocab]
        if outside:  # the generation would say so only once it starts: after a stream's first bytes
            vocab = f"0..{model.info.n_vocab - 1}"
            raise GrammarError(f"token id {outside[0]} is outside the vocabulary ({vocab})", param="logit_bias")
        needed = len(ids) + sampling.max_tokens
        limit, why = model.info.n_ctx, "the model's context (engine.n_ctx)"
        policy_ctx = self.arbiter.max_context
        if policy_ctx is not None and policy_ctx < limit:
            limit, why = policy_ctx, "the policy under memory pressure (shrink_context)"
        if needed > limit:
            raise ContextTooLong(needed, limit, why, len(ids))
        model = self._admit()  # tokenizing took a moment: check again
        stable = await self._stable_prefix(prompt, extras, ids)
        return HostedGeneration(self, ids, sampling, priority, prepared, stable)

    async def _stable_prefix(self, prompt: Prompt, extras: RequestExtras, ids: list[int]) -> int:
        """Tokens of a chat prompt that its system messages and tools make (what the prompt cache
        saves); 0 for text or token prompts and without a cache."""
        cache = self.model_cache
        items: list[Any] = [] if isinstance(prompt, str) else list(prompt)
        if cache is None or len(ids) <= cache.store.min_tokens or not items:
            return 0
        if not all(isinstance(m, Mapping) for m in items):
            return 0
        tools = [dict(t) for t in extras.tools] if extras.tools_active else None
        return await anyio.to_thread.run_sync(cache.stable_prefix, [dict(m) for m in items], tools, ids)

    def _admit(self) -> Model:
        if self.closing:
            raise EngineUnavailable("the supervisor is shutting down")
        if self.model is None:
            detail = f": {self.error}" if self.error else ""
            raise EngineUnavailable(f"no model is loaded (engine {self.state}{detail})")
        if self.arbiter.refuse_new:
            raise RequestRefused("new requests are refused while memory is low (policy memory.thresholds)")
        return self.model

    @staticmethod
    async def _tokenize(model: Model, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return await anyio.to_thread.run_sync(model.tokenizer.encode, prompt)
        items: list[Any] = list(prompt)
        if all(isinstance(t, int) for t in items):
            return [int(t) for t in items]
        if all(isinstance(m, Mapping) for m in items):
            return await anyio.to_thread.run_sync(model.encode_chat, [dict(m) for m in items])
        raise ValueError("a prompt is token ids, a string, or a list of chat messages")

    def describe(self) -> dict[str, Any]:
        """Model, backend, memory plan and state for /health and /status."""
        plan = self.memory_plan
        info = self.model.info if self.model is not None else None
        return {
            "state": self.state,
            "model": info.name if info else None,
            "path": self.model_path,
            "arch": info.arch if info else None,
            "backend": self.backend,
            "n_ctx": info.n_ctx if info else self._n_ctx,
            "kv_dtype": self._kv_dtype,
            "error": self.error,
            "memory_plan": None
            if plan is None
            else {**plan_parts_mb(plan), "budget_mb": None},  # ModelManager.describe fills it in
        }
