"""Model roles and groups: memory-budgeted loading, swapping and unloading (llama-swap's job).

    manager = ModelManager(cfg, ctx, publish=...)
    arbiter.attach(models=manager)                 # the arbiter pushes each decision's budget
    await tg.start(manager.run)                    # resident models loaded (READY waits for them)
    async with manager.lease("brain") as lease:     # by id or role; loads / swaps in as needed
        stream = await lease.backend.generate(messages, sampling, "tool")

Rules: resident models are loaded at start and never evicted; members of a swap group are loaded
one at a time; before a load, the model's memory plan must fit the LLM budget (the policy's
``memory.llm_budget_mb``, pushed by the arbiter with each decision that changes it) next to
what is loaded, else models are evicted in order (idle before busy, non-resident only, lowest
priority, least recently used) or the load is refused with the numbers (the context is never
shrunk). A model is evicted only once its running requests have finished (drain). One load runs
at a time, in the manager's own task, shared by every request that waits for it (bounded by
``api.load_wait_s``); while it runs the model reports ``loading``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus

from ..config import Config
from ..errors import (
    BackendUnavailable,
    EngineUnavailable,
    LlmDisabled,
    ModelTooLarge,
    UnknownModel,
)
from ..events import EngineStats, Observation, RequestDone
from ..startup import since_process_start
from ..state import DEFAULT_LLM_BUDGET_MB
from .engine_view import EngineView
from .managed_model import (
    Lease,
    ManagedModel,
    aggregate_stats,
    first_token,
    load_error,
    next_victim,
    preloads,
)
from .serving import BackendContext, Plan, create_backend

log = structlog.get_logger(__name__)


class ModelManager(EngineView):
    """Loads, swaps and unloads the configured models within the LLM memory budget."""

    def __init__(
        self,
        cfg: Config,
        ctx: BackendContext,
        *,
        budget_mb: float | None = DEFAULT_LLM_BUDGET_MB,
        publish: Callable[[Observation], None],
        queued: Callable[[], int] = lambda: 0,
        on_banner: Callable[[str], None] = lambda _text: None,
    ) -> None:
        self.cfg = cfg
        """The daemon config."""
        self.ctx = ctx
        """What backends are built with."""
        self.enabled = True
        """False while the LLM is switched off."""
        self.closing = False
        """Set at shutdown."""
        self.models: dict[str, ManagedModel] = {}
        """Models by id, in config order."""
        self._budget_mb = budget_mb
        self._publish = publish
        self._queued = queued
        self._on_banner = on_banner
        self._host_stats: dict[str, EngineStats] = {}
        self._changed: anyio.Event | None = None
        self._load_lock: anyio.Lock | None = None
        self._tg: TaskGroup | None = None
        self.started = False
        """True once the resident models were loaded at the start (`run` is ready): /health says ok."""
        self.ready_s: float | None = None
        """Seconds from process start until then (`startup.since_process_start`)."""
        self.first_reply_ms: dict[str, float | None] = {}
        """Warm-up time to first token per resident model (the startup banner)."""
        self.unloads: Counter[str] = Counter()
        """model id -> unloads (any cause)."""
        for mid, entry in cfg.model_entries().items():
            kind = entry.backend or cfg.backend
            self.models[mid] = ManagedModel(mid, entry, kind, create_backend(kind, mid, entry, self._context(mid)))
        self._names = {name: m for m in self.models.values() for name in m.names}

    def _context(self, mid: str) -> BackendContext:
        """What model `mid`'s backend is built with: its stats feed, leases on the others, change notices."""
        c = self.ctx
        return BackendContext(
            self.cfg, c.gate, c.arbiter, self._stats_from(mid), c.loader, self.lease, self._notify, c.prompt_cache
        )

    # -- lookup (the default model: EngineView.default) ---------------------------------------
    def resolve(self, name: str | None, *, fallback: bool = False) -> ManagedModel:
        """The model a request names (id or role; None or "" = the default); UnknownModel if none.

        With `fallback` (generation requests), an unknown name is served by the one configured
        model when ``api.unknown_model`` is ``default``, as llama-server ignores the name; with
        several models it stays a 404."""
        if not name:
            m = self.default
            if m is None:
                raise EngineUnavailable("no model is configured (engine.model or models)")
            return m
        m = self._names.get(name)
        if m is None and fallback and self.cfg.api.unknown_model == "default" and len(self.models) == 1:
            return next(iter(self.models.values()))
        if m is None:
            known = ", ".join(sorted(self._names)) or "none"
            raise UnknownModel(f"model {name!r} does not exist (known ids and roles: {known})")
        return m

    # -- the budget (pushed by the arbiter) -------------------------------------------------
    @property
    def budget_mb(self) -> float | None:
        """The LLM memory budget loads are checked against (MiB; None: no limit)."""
        return self._budget_mb

    def apply_budget(self, mb: float | None) -> None:
        """Check loads from now on against `mb` MiB (None: no limit); what is loaded stays."""
        self._budget_mb = mb

    # -- change notification ----------------------------------------------------------------
    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        self.publish_stats()

    async def _wait_change(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    # -- leases -----------------------------------------------------------------------------
    @asynccontextmanager
    async def lease(self, name: str | ManagedModel | None) -> AsyncIterator[Lease]:
        """Hold a ready model for the block (loading or swapping it in first, bounded)."""
        m = name if isinstance(name, ManagedModel) else self.resolve(name)
        await self._ready(m)
        m.in_flight += 1
        m.last_used = time.monotonic()
        self._notify()
        try:
            yield Lease(m)
        finally:
            m.in_flight -= 1
            m.last_used = time.monotonic()
            self._notify()

    async def _ready(self, m: ManagedModel) -> None:
        wait_s = self.cfg.api.load_wait_s
        seen_loading = False
        m.waiting += 1
        try:
            with anyio.fail_after(wait_s):
                while True:
                    if self.closing:
                        raise EngineUnavailable("the supervisor is shutting down")
                    if not self.enabled:
                        raise LlmDisabled(
                            "the LLM is switched off (MQTT llm/enabled); requests are refused until it is on"
                        )
                    if self.ctx.arbiter.refuse_new:
                        raise EngineUnavailable(
                            "new requests are refused while memory is low (policy memory.thresholds)"
                        )
                    if m.state == "ready" and not m.draining:
                        return
                    if m.state == "loading":
                        seen_loading = True
                    elif m.state == "error" and seen_loading and m.exc is not None:
                        raise load_error(m)
                    elif m.state in ("unloaded", "error") and not m.draining:
                        self._start_load(m)
                        seen_loading = True
                        continue
                    await self._wait_change()
        except TimeoutError:
            raise EngineUnavailable(
                f"model {m.id!r} was not ready within {wait_s:g} s (state {m.state}; api.load_wait_s)"
            ) from None
        finally:
            m.waiting -= 1
            self._notify()

    def _start_load(self, m: ManagedModel) -> None:
        if self._tg is None:
            raise EngineUnavailable("the model manager is not running")
        m.state, m.error, m.exc = "loading", None, None
        self._notify()
        self._tg.start_soon(self._load, m)

    # -- loading and eviction ---------------------------------------------------------------
    async def _load(self, m: ManagedModel) -> None:
        assert self._load_lock is not None
        t0 = time.monotonic()
        try:
            async with self._load_lock:
                try:
                    await self._load_with(m)
                except (BackendUnavailable, ModelTooLarge, OSError) as exc:
                    fallback = self.cfg.fallback
                    if not fallback or fallback == m.kind:
                        raise
                    log.warning(
                        "backend_fallback",
                        model=m.id,
                        backend=m.kind,
                        fallback=fallback,
                        reason=f"{type(exc).__name__}: {exc}",
                    )
                    m.backend = create_backend(fallback, m.id, m.entry, self._context(m.id))
                    m.kind, m.fell_back = fallback, True
                    await self._load_with(m)
        except Exception as exc:
            m.state, m.error, m.exc = "error", f"{type(exc).__name__}: {exc}", exc
            log.error("model_load_failed", model=m.id, backend=m.kind, error=m.error)
        else:
            m.state, m.loaded_at = "ready", time.monotonic()
            m.load_seconds = m.loaded_at - t0
            m.loads += 1
            log.info(
                "model_ready",
                model=m.id,
                roles=m.entry.roles,
                backend=m.backend.identity(),
                memory_mb=round(m.plan_mb or 0, 1),
                load_s=round(m.load_seconds, 3),
            )
        finally:
            self._notify()

    async def _load_with(self, m: ManagedModel) -> None:
        m.plan = await m.backend.plan()
        await self._make_room(m, m.plan)
        self._notify()
        await m.backend.load()

    async def _make_room(self, m: ManagedModel, plan: Plan) -> None:
        while (victim := next_victim(m, plan, list(self.models.values()), self._budget_mb)) is not None:
            await self._evict(victim, reason=f"make room for {m.id}")

    async def _evict(self, victim: ManagedModel, *, reason: str, force: bool = False) -> None:
        """Drain (or, with `force`, stop) the victim's requests, then unload it."""
        if not force:  # requests that waited for it while it loaded get their turn first
            with anyio.move_on_after(self.cfg.api.drain_timeout_s):
                while victim.waiting and victim.state == "ready":
                    await self._wait_change()
        victim.draining = True
        self._notify()
        try:
            if not force:
                try:
                    with anyio.fail_after(self.cfg.api.drain_timeout_s):
                        while victim.in_flight:
                            await self._wait_change()
                except TimeoutError:
                    raise EngineUnavailable(
                        f"model {victim.id!r} still runs {victim.in_flight} request(s) after "
                        f"{self.cfg.api.drain_timeout_s:g} s (api.drain_timeout_s); "
                        "it is not cut off"
                    ) from None
            await victim.backend.unload(timeout=self.cfg.api.drain_timeout_s if force else 2.0)
            victim.state, victim.loaded_at = "unloaded", None
            if reason.startswith("make room"):
                victim.evictions += 1
            self.unloads[victim.id] += 1
            log.info("model_unloaded", model=victim.id, reason=reason, forced=force)
        finally:
            victim.draining = False
            self._notify()

    async def unload(self, name: str | None = None, *, force: bool = False) -> list[str]:
        """Unload one model (or every loaded one): drain first unless `force`; returns the ids unloaded."""
        targets = [self.resolve(name)] if name else [m for m in self.models.values() if m.state == "ready"]
        done = []
        for m in targets:
            if m.state != "ready" or m.draining:
                continue
            await self._evict(m, reason="unload requested", force=force)
            done.append(m.id)
        return done

    async def set_enabled(self, enabled: bool) -> None:
        """Switch the LLM on (residents reload) or off (requests get 503; models unload after draining)."""
        self.enabled = enabled
        log.info("llm_enabled" if enabled else "llm_disabled")
        self._notify()
        if enabled:
            for m in self.models.values():
                if m.entry.resident and m.state in ("unloaded", "error"):
                    self._start_load(m)
        else:
            await self.unload()

    # -- lifecycle --------------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Load the resident models (their failure stops the start), then keep watch (TTL, health)."""
        self._changed = anyio.Event()
        self._load_lock = anyio.Lock()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self.publish_stats()
            residents = [m for m in self.models.values() if m.entry.resident]
            first = preloads(list(self.models.values()))
            for m in residents + first:
                self._start_load(m)
            while any(m.state == "loading" for m in residents + first):
                await self._wait_change()
            for m in residents:
                if m.state == "error" and m.exc is not None:
                    raise m.exc
            self.started, self.ready_s = True, since_process_start()
            self._notify()
            task_status.started()
            tg.start_soon(self._publish_while_busy)
            warm = residents + [m for m in first if m.state == "ready"]
            if self.cfg.api.warmup and warm:
                tg.start_soon(self._warmup, warm)
            await self._watch()

    async def _publish_while_busy(self) -> None:
        """Refresh the engine stats every second while something generates (decode speed moves)."""
        while True:
            if any(m.in_flight for m in self.models.values()):
                await anyio.sleep(1.0)
                for m in self.models.values():
                    host = getattr(m.backend, "host", None)
                    if m.in_flight and host is not None:
                        host.publish_stats()
                self.publish_stats()
            else:
                await self._wait_change()

    async def _watch(self) -> None:
        interval = min(
            [self.cfg.llama_cpp.health_interval_s, self.cfg.openai.health_interval_s]
            + [m.entry.ttl_s / 2 for m in self.models.values() if m.entry.ttl_s]
            + [5.0]
        )
        while True:
            await anyio.sleep(max(0.05, interval))  # periodic upkeep: TTLs and backend health
            now = time.monotonic()
            for m in list(self.models.values()):
                if m.state != "ready" or m.draining or self.closing:  # shutting down: backends are closing
                    continue
                ttl = m.entry.ttl_s
                if ttl and not m.entry.resident and m.in_flight == 0 and now - m.last_used > ttl:
                    await self._evict(m, reason=f"idle for {ttl:g} s (ttl_s)")
                    continue
                problem = await m.backend.check()
                if problem is not None and m.in_flight == 0:
                    log.error("backend_unhealthy", model=m.id, backend=m.backend.identity(), problem=problem)
                    await m.backend.unload()
                    m.state, m.error, m.exc = "error", problem, BackendUnavailable(problem)
                    self._notify()

    async def _warmup(self, residents: list[ManagedModel]) -> None:
        for m in residents:
            t0 = time.monotonic()
            try:
                async with self.lease(m) as lease:
                    await first_token(lease.backend)
                self.first_reply_ms[m.id] = round((time.monotonic() - t0) * 1000.0, 1)
            except Exception as exc:  # a banner, not a start condition
                self.first_reply_ms[m.id] = None
                log.warning("warmup_failed", model=m.id, error=f"{type(exc).__name__}: {exc}")
        banner = ", ".join(
            f"{mid} {ms:.0f} ms" if ms is not None else f"{mid} failed" for mid, ms in self.first_reply_ms.items()
        )
        text = f"first reply latency: {banner}"
        log.info("first_reply_latency", models=self.first_reply_ms, banner=text)
        self._on_banner(text)

    async def shutdown(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - a bounded drain
        """Refuse new requests, stop running generations at their next step, unload (bounded)."""
        self.closing = True
        self._notify()
        with anyio.move_on_after(timeout):
            for m in self.models.values():
                if m.state == "ready":
                    await m.backend.shutdown(timeout=timeout)
        self.enabled = False
        self.publish_stats()

    # -- stats ------------------------------------------------------------------------------
    def _stats_from(self, mid: str) -> Callable[[Observation], None]:
        def take(obs: Observation) -> None:
            if isinstance(obs, EngineStats):
                self._host_stats[mid] = obs
                self.publish_stats()

        return take

    def record(self, done: RequestDone, timings: dict[str, float]) -> None:
        """Count one finished request and publish it (the store keeps the last few)."""
        self.models[done.model].usage.record(done.prompt_tokens, done.completion_tokens, timings)
        self._publish(done)

    def stats(self) -> EngineStats:
        """The aggregate EngineStats: the busiest model's state, totals over all models."""
        ms = list(self.models.values())
        if not ms or (not self.enabled and not any(m.in_flight for m in ms)):
            return EngineStats(state="disabled", requests_queued=self._queued())
        assert self.default is not None
        return aggregate_stats(ms, self._host_stats, self.default, self._queued(), self.ctx.gate.mode, self.ready_s)

    def publish_stats(self) -> None:
        """Publish the aggregate EngineStats to the state store."""
        self._publish(self.stats())
