"""The composition root: ``genie-supervisor run`` builds every part and runs them in one task group.

    sup = Supervisor(load_config(None, {"model": path}), telemetry_source=SimulatedSource())
    async with sup:                     # returns once every component has started (READY=1)
        ...                             # sup.store, sup.gate, sup.engine, sup.http.port
    # leaving the block shuts down gracefully (generations cancelled, STOPPING=1)

Start order (each with ``await tg.start``, so READY=1 means all of them are up): signals, state
expiry, policy (first load; a bad file stops the start), arbiter, telemetry sampler, then the
model manager (its loads run in a worker thread) while the watchers and the HTTP server start,
then, once the models are up, MQTT. SIGTERM/SIGINT shut down within ``api.shutdown_timeout_s``
(under ``genie-supervisor run`` an `ExitDeadline` ends the process at that bound even when a worker
thread is stuck in one long call); SIGHUP reloads the policy (a bad file keeps the old one, and says
so in /status). The policy in force and its run-time controls (select, thermal soft limit, reload, the
MQTT wiring) are `SupervisorControls` (controls.py); the ``genie-supervisor run`` process is run.py.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import structlog
from anyio.abc import TaskGroup, TaskStatus

from . import __version__, gc_start
from .arbiter import Arbiter, DecodeGate
from .config import Config, parse_hostport
from .controls import SupervisorControls
from .errors import SupervisorError
from .exit_deadline import ExitDeadline
from .llm.admission import Admission
from .llm.manager import ModelManager
from .llm.prompt_cache import describe as describe_prompt_cache
from .llm.prompt_cache import open_prompt_cache
from .llm.serving import BackendContext
from .policy import Policy, PolicyWatcher
from .policy.schema import builtin_policy
from .startup import release_early, startup_status
from .state import StateStore
from .systemd import Notifier
from .telemetry import TelemetrySource, configured_source, run_sampler
from .ui.feed import UiFeed
from .urls import redact_url
from .voice import VoiceHints

if TYPE_CHECKING:  # the API (FastAPI) is imported when the HTTP server starts, while the model loads
    from .api.deps import ApiDeps
    from .api.server import HttpServer

if sys.version_info < (3, 11):  # pragma: no cover - Python 3.10 (JetPack 6)
    from exceptiongroup import BaseExceptionGroup

log = structlog.get_logger(__name__)


class _CountedVoiceHints(VoiceHints):
    """Voice hints, counted per (service, event, source) for /metrics."""

    def __init__(self, store: StateStore) -> None:
        super().__init__(store)
        self.counts: dict[tuple[str, str, str], int] = {}
        """(service, start|stop, http|mqtt) -> hints handled."""

    def handle(self, payload: Any, source: str) -> Any:
        activity = super().handle(payload, source)
        key = (activity.service, "start" if activity.active else "stop", source)
        self.counts[key] = self.counts.get(key, 0) + 1
        return activity


class Supervisor(SupervisorControls):
    """Every component of the daemon, wired; `run` starts them and owns their lifetime."""

    def __init__(
        self,
        cfg: Config,
        *,
        telemetry_source: TelemetrySource | None = None,
        notifier: Notifier | None = None,
        http_socket: socket.socket | None = None,
        handle_signals: bool = False,
        environ: Mapping[str, str] | None = None,
        model_loader: Any = None,
        shutdown_timeout_s: float | None = None,
        exit_deadline: ExitDeadline | None = None,
        gate: DecodeGate | None = None,
    ) -> None:
        """Fakes come in here: a telemetry source (e.g. SimulatedSource), a notifier, a bound
        HTTP socket (tests bind port 0), a model loader. `handle_signals` makes this process's
        SIGTERM/SIGINT/SIGHUP ours (the CLI does; tests usually do not). `exit_deadline` (the CLI's)
        ends the process once a stop has taken `shutdown_timeout_s` (default ``api.shutdown_timeout_s``),
        even with a worker thread stuck in one long call. `gate`: a decode gate (e.g. on a fake clock)."""
        self.cfg = cfg
        """The validated config."""
        self.version = __version__
        """Package version (in /health)."""
        env = os.environ if environ is None else environ
        self.notifier = notifier or Notifier.from_env(env, notify=cfg.systemd.notify, watchdog=cfg.systemd.watchdog)
        """systemd notifications (inactive without NOTIFY_SOCKET)."""
        self.store = StateStore(hint_timeout_s=cfg.voice.hint_timeout_s, stt_services=cfg.stt_services())
        """The snapshot store every observation goes to."""
        self.gate = gate or DecodeGate()
        """The decode gate the engine awaits."""
        self.arbiter = Arbiter(self.gate, on_unload=self._on_unload)
        """Applies decisions."""
        self.voice = _CountedVoiceHints(self.store)
        """Voice hint handler (HTTP route and MQTT topic); counts events for /metrics."""
        self.policy_watcher = (
            PolicyWatcher(cfg.policy.path, poll_interval_s=cfg.policy.poll_interval_s) if cfg.policy.path else None
        )
        """Loads and reloads the policy file; None when the built-in policy is used."""
        self._builtin = builtin_policy() if self.policy_watcher is None else None
        if self.policy_watcher is not None:
            self.policy_watcher.add_listener(self._on_policy)
        self.admission = Admission(
            max_running=cfg.api.max_running, max_queue=cfg.api.max_queue, on_change=self._on_queue_change
        )
        """The API's priority queue and slots."""
        self.prompt_cache = open_prompt_cache(cfg.prompt_cache)
        """The prompt cache on disk of the builtin models (None: ``prompt_cache.enabled`` is false)."""
        self.models = ModelManager(
            cfg,
            BackendContext(
                cfg, self.gate, self.arbiter, self.store.publish, model_loader, prompt_cache=self.prompt_cache
            ),
            publish=self.store.publish,
            queued=lambda: self.admission.queued,
            on_banner=self._banner,
        )
        """Model roles, groups, loading and swapping within the memory budget."""
        self.arbiter.attach(models=self.models, admission=self.admission)  # budget and classes come with decisions
        self.engine = self.models
        """The LLM side as one engine view (state, backend, describe, direct generate)."""
        self.ui = UiFeed(
            self.store, self.gate, self.models, self.control_actions(), decision=lambda: self.arbiter.decision
        )
        """The web page's timeline and live stream (``/ui``)."""
        self.arbiter.add_listener(self.ui.poke)
        self.thermal_soft_limit: float | None = None
        """Override of the first thermal level's enter_c (MQTT number), None = the policy's own."""
        self._limited: tuple[tuple[int, float], Policy] | None = None
        self.http: HttpServer | None = None
        """The HTTP server once started."""
        self.mqtt: Any = None
        """The MQTT bridge when configured and available."""
        self.ready = False
        """True once every component has started."""
        self.shutdown_timeout_s = cfg.api.shutdown_timeout_s if shutdown_timeout_s is None else shutdown_timeout_s
        """Graceful shutdown must finish within this."""
        self.exit_deadline = exit_deadline
        """Armed when a stop begins: the process is gone `shutdown_timeout_s` later (None in-process)."""
        self._source = telemetry_source
        self._owns_source = telemetry_source is None
        self._http_socket = http_socket
        self._handle_signals = handle_signals
        self._t0 = time.monotonic()
        self._tg: TaskGroup | None = None
        self._stop: anyio.Event | None = None
        self._stop_reason: str | None = None
        self._stopped: anyio.Event | None = None
        self._outer: TaskGroup | None = None

    # -- state ------------------------------------------------------------------------------
    @property
    def uptime_s(self) -> float:
        """Seconds since `run` began."""
        return time.monotonic() - self._t0

    def status(self) -> dict[str, Any]:
        """The whole state as JSON values (``GET /status``)."""
        from .api.ops import jsonable

        snap = self.store.snapshot()
        watcher = self.policy_watcher
        return {
            "ts": snap.ts,
            "uptime_s": round(self.uptime_s, 3),
            "version": self.version,
            "node_id": self.cfg.node_id,
            "ready": self.ready,
            "telemetry": jsonable(snap.telemetry),
            "services": jsonable(snap.services),
            "voice": jsonable(snap.voice),
            "engine": {**self.engine.describe(), "stats": jsonable(snap.engine)},
            "backend": {
                "configured": self.cfg.backend,
                "fallback": self.cfg.fallback,
                "default": self.engine.describe()["backend_identity"],
            },
            "models": [m.describe() for m in self.models.models.values()],
            "admission": self.admission.describe(),
            "first_reply_ms": dict(self.models.first_reply_ms),
            "requests": jsonable(snap.requests),
            "startup": startup_status(self.models),
            "gate": self.gate.metrics(),
            "policy": {
                "name": snap.policy_name,
                "path": watcher.path if watcher else None,
                "error": snap.policy_error,
                "generation": watcher.generation if watcher else 1,
            },
            "decision": jsonable(snap.decision),
            "memory_plan": self.engine.describe()["memory_plan"],
            "prompt_cache": describe_prompt_cache(self.prompt_cache),
            "http": {"listen": self.http.address if self.http else None},
            "mqtt": self.mqtt.status()
            if self.mqtt is not None
            else {
                "url": redact_url(self.cfg.mqtt.url),
                "enabled": False,
                "broker": None,
                "connected": False,
                "since": None,
                "last_error": None,
            },
            "systemd": {"notify_socket": self.notifier.socket_path, "watchdog_s": self.notifier.watchdog_s},
        }

    def _api_deps(self) -> ApiDeps:
        """What the HTTP routes may use of this daemon."""
        from .api.deps import ApiDeps

        return ApiDeps(
            config=self.cfg,
            admission=self.admission,
            models=self.models,
            gate=self.gate,
            voice=self.voice,
            policy=lambda: self.policy,
            decision=lambda: self.arbiter.decision,
            status=lambda: self.status(),
            uptime_s=lambda: self.uptime_s,
            version=self.version,
            controls=self.control_actions(),
            ui=self.ui,
            prompt_cache=lambda: describe_prompt_cache(self.prompt_cache),
        )

    def _on_unload(self) -> None:
        # The policy says unload_llm (which implies refuse_new): drain and unload every model.
        log.warning("unload_llm_requested", action="draining and unloading every model")
        if self._tg is not None:
            self._tg.start_soon(self.models.unload)

    def _banner(self, text: str) -> None:
        self.notifier.status(text)  # `systemctl status` shows it
        if sys.stderr.isatty():
            print(text, file=sys.stderr)

    def _on_queue_change(self) -> None:
        if self.models is not None:
            self.models.publish_stats()

    # -- lifecycle --------------------------------------------------------------------------
    def request_stop(self, reason: str = "requested") -> None:
        """Begin a graceful shutdown (during start-up: cancel the start)."""
        if self._stop_reason is None:
            self._stop_reason = reason
        if self.exit_deadline is not None:
            self.exit_deadline.arm(self.shutdown_timeout_s, reason)
        if self._stop is not None:
            self._stop.set()
        if not self.ready and self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def run(self, *, task_status: TaskStatus[Supervisor] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start every component, announce readiness, run until asked to stop, then shut down.

        Raises PolicyErrors (bad policy), TelemetryUnavailable, ModelTooLarge, EngineError or
        SupervisorError (cannot listen) when start-up fails.
        """
        self._t0 = time.monotonic()
        self._stop = anyio.Event()
        self._stopped = anyio.Event()
        self.notifier.status("starting")
        log.info(
            "supervisor_starting",
            version=self.version,
            node_id=self.cfg.node_id,
            models=list(self.models.models),
            backend=self.cfg.backend,
            fallback=self.cfg.fallback,
            policy=self.cfg.policy.path or "builtin",
            platform=self.cfg.telemetry.platform,
            listen=self.cfg.http.listen,
        )
        source: TelemetrySource | None = None
        sock: socket.socket | None = self._http_socket
        try:
            if self.policy_watcher is not None:
                await self.policy_watcher.load()
            else:
                self._on_policy(self.policy, None)
            source = self._source or await anyio.to_thread.run_sync(self._create_source)
            assert source is not None
            sock = sock or self._bind()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self._stop_reason is not None:
                    tg.cancel_scope.cancel()
                await self._start_all(tg, source, sock)
                self.ready = True
                release_early()  # a model loaded at process start that nobody took (before the freeze)
                gc_start.release()  # `run` held the collector off until now
                self.notifier.ready(
                    f"serving on {self.http.address if self.http else '-'}; "
                    f"policy {self.policy.name}; engine {self.engine.state}"
                )
                log.info(
                    "supervisor_ready",
                    **startup_status(self.models),
                    listen=self.http.address if self.http else None,
                    engine=self.engine.state,
                    backend=self.engine.backend,
                    backend_identity=self.engine.describe()["backend_identity"],
                    policy=self.policy.name,
                    platform=source.name,
                )
                task_status.started(self)
                await self._stop.wait()
                await self._shutdown()
                tg.cancel_scope.cancel()
        finally:
            self.ready = False
            if not any(m.startswith("STOPPING=1") for m in self.notifier.sent):
                self.notifier.stopping()
            if source is not None and self._owns_source:
                source.close()
            if sock is not None:
                sock.close()  # ours (or handed to us); closing twice is harmless
            self._stopped.set()
            log.info("supervisor_stopped", reason=self._stop_reason)

    async def _start_all(self, tg: TaskGroup, source: TelemetrySource, sock: socket.socket) -> None:
        cfg = self.cfg
        if self._handle_signals:
            await tg.start(self._signals)
        await tg.start(self.store.run_expiry)
        if self.policy_watcher is not None and cfg.policy.watch:
            await tg.start(self.policy_watcher.run)
        await tg.start(self.arbiter.run, self.store, lambda: self.policy)
        await tg.start(self.ui.run)
        await tg.start(run_sampler, source, self.store.publish, cfg.telemetry.interval_s)
        models_up = anyio.Event()

        async def start_models() -> None:  # the load (a worker thread) overlaps the rest of the start
            await tg.start(self.models.run)
            models_up.set()

        tg.start_soon(start_models)
        if cfg.services:  # the watchers' modules (and httpx, for a health URL) only when there is one to watch
            from .watchers import build_watchers

            watchers = build_watchers(cfg.services, self.store.publish, wait_parked=self.gate.wait_parked)
            async with anyio.create_task_group() as starting:  # first rounds at once: the slowest, not their sum
                for watcher in watchers:
                    starting.start_soon(tg.start, watcher.run)
        from .api.server import HttpServer, create_app

        self.http = HttpServer(create_app(self._api_deps()), sock)
        await tg.start(self.http.run)
        log.info("http_listening", address=self.http.address)
        await models_up.wait()
        await self._start_mqtt(tg)
        await tg.start(self.notifier.run_watchdog)

    async def _signals(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    log.info("signal_received", signal=name, action="reload policy")
                    await self.reload_policy()
                elif self._stop_reason is not None and self._tg is not None:
                    log.warning("signal_received", signal=name, action="second stop signal: cancelling now")
                    self._tg.cancel_scope.cancel()
                else:
                    log.info("signal_received", signal=name, action="shutdown")
                    self.request_stop(name)

    async def _shutdown(self) -> None:
        """Stop in order within the deadline: STOPPING=1, generations, HTTP, prompt cache writes; then the group is cancelled."""
        t0 = time.monotonic()
        self.notifier.stopping()
        log.info("supervisor_stopping", reason=self._stop_reason)
        budget = max(0.5, self.shutdown_timeout_s - 1.0)
        with anyio.move_on_after(budget):
            await self.models.shutdown(timeout=budget * 0.4)
            self.ui.close()  # open pages' streams end, so the HTTP server can drain
            if self.http is not None:
                await self.http.stop(timeout=budget * 0.5)
            if self.prompt_cache is not None:  # a prompt cache file still being written is finished
                flush = self.prompt_cache.flush
                await anyio.to_thread.run_sync(flush, budget * 0.3, abandon_on_cancel=True)
        if self.prompt_cache is not None:  # its read threads would hold the exit until forced
            self.prompt_cache.close()
        log.info("supervisor_drained", seconds=round(time.monotonic() - t0, 3))

    def _create_source(self) -> TelemetrySource:
        return configured_source(self.cfg.telemetry)

    def _bind(self) -> socket.socket:
        host, port = parse_hostport(self.cfg.http.listen)
        try:
            from .api.server import bind_socket

            return bind_socket(host, port)
        except OSError as exc:
            raise SupervisorError(f"http.listen {self.cfg.http.listen}: cannot listen: {exc.strerror or exc}") from exc

    # -- as an async context manager (tests) --------------------------------------------------
    async def __aenter__(self) -> Supervisor:
        self._outer = anyio.create_task_group()
        await self._outer.__aenter__()
        try:
            await self._outer.start(self.run)
        except BaseException as exc:  # a start-up error: close the group, raise the error itself
            try:
                await self._outer.__aexit__(type(exc), exc, exc.__traceback__)
            except BaseException:  # noqa: B036 - the group re-raises `exc` (wrapped); raise it plainly
                pass
            raise _unwrap(exc) from None
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        self.request_stop("context exit")
        assert self._outer is not None
        return await self._outer.__aexit__(*exc_info)


def _unwrap(exc: BaseException) -> BaseException:
    """The single real error inside (nested) exception groups, else `exc` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
