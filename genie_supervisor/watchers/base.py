"""Probes and the service watcher that merges them into one ServiceObservation per interval.

A probe looks at one aspect of a service (its processes, its cgroup, an HTTP health route, a log)
and returns a `ProbeResult`. A `ServiceWatcher` runs its probes every `interval_s`, off the loop
where they block, and publishes the merged result. Sources that push instead of being polled (the
Wyoming proxy) hand their results to `ServiceWatcher.report`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import anyio
import structlog
from anyio.abc import TaskStatus

from genie_supervisor.events import Observation, ServiceObservation

log = structlog.get_logger(__name__)

Publish = Callable[[Observation], None]
"""The StateStore's publish: sync, called for every observation."""

WaitParked = Callable[[float], Awaitable[bool]]
"""Awaits until the LLM engine is parked or the timeout (seconds) passed; returns whether parked."""


@dataclass(frozen=True)
class ProbeResult:
    """What one probe saw of a service; a ServiceWatcher merges several into one observation."""

    up: bool | None
    """True up, False down, None unknown (see ServiceObservation.up)."""
    reason: str = ""
    """Why, in a few words (``3 processes``, ``health 503``, ``connect refused``)."""
    rss_mb: float | None = None
    """Resident memory or cgroup memory in MiB."""
    cpu_pct: float | None = None
    """CPU use in percent of one core."""
    gpu_mem_mb: float | None = None
    """GPU memory of the service's processes in MiB."""
    restarts: int = 0
    """Restarts this probe has counted since it started."""
    pids: tuple[int, ...] = ()
    """Process ids found."""
    counters: dict[str, int] = field(default_factory=dict)
    """Service-specific counters (e.g. ``dfn_underruns``)."""
    decides_up: bool = True
    """False for probes that only add numbers (a log counter): their ``up`` is not merged."""


@runtime_checkable
class Probe(Protocol):
    """One way of looking at a service; `probe` never raises for an absent service."""

    source: str
    """Short name of the probe (``process``, ``cgroup``, ``http``, ``dfn_log``)."""

    async def probe(self) -> ProbeResult:
        """Look once and report."""
        ...


def merge(service: str, results: dict[str, ProbeResult]) -> ServiceObservation:
    """Fold the latest result of each source into one observation (any down wins, then unknown)."""
    deciders = {s: r for s, r in results.items() if r.decides_up}
    if not deciders:
        up: bool | None = None
        reasons = ["no health source"] if not results else []
    elif any(r.up is False for r in deciders.values()):
        up = False
        reasons = [f"{s}: {r.reason}" for s, r in deciders.items() if r.up is False]
    elif any(r.up is None for r in deciders.values()):
        up = None
        reasons = [f"{s}: {r.reason}" for s, r in deciders.items() if r.up is None]
    else:
        up = True
        reasons = [f"{s}: {r.reason}" for s, r in deciders.items() if r.reason]
    reasons += [f"{s}: {r.reason}" for s, r in results.items() if not r.decides_up and r.reason]
    counters: dict[str, int] = {}
    for r in results.values():
        counters.update(r.counters)
    return ServiceObservation(
        service=service,
        up=up,
        reason="; ".join(reasons),
        rss_mb=_first(r.rss_mb for r in results.values()),
        cpu_pct=_first(r.cpu_pct for r in results.values()),
        gpu_mem_mb=_first(r.gpu_mem_mb for r in results.values()),
        restarts=max((r.restarts for r in results.values()), default=0),
        pids=tuple(sorted({p for r in results.values() for p in r.pids})),
        counters=counters,
    )


def _first(values: Any) -> Any:
    return next((v for v in values if v is not None), None)


class ServiceWatcher:
    """Runs a service's probes every `interval_s` and publishes one merged ServiceObservation."""

    def __init__(
        self,
        name: str,
        probes: Sequence[Probe],
        publish: Publish,
        *,
        interval_s: float = 2.0,
        probe_timeout_s: float = 5.0,
    ) -> None:
        self.name = name
        self.probes = list(probes)
        self.publish = publish
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self._latest: dict[str, ProbeResult] = {}
        self.last: ServiceObservation | None = None
        """The observation published last."""

    def report(self, source: str, result: ProbeResult) -> None:
        """Take a result pushed by a source outside the probe loop and publish the merged view."""
        self._latest[source] = result
        self._publish()

    def _publish(self) -> None:
        self.last = merge(self.name, self._latest)
        self.publish(self.last)

    async def _probe_one(self, probe: Probe) -> None:
        try:
            with anyio.fail_after(self.probe_timeout_s):
                result = await probe.probe()
        except TimeoutError:
            result = ProbeResult(up=None, reason=f"probe timed out after {self.probe_timeout_s}s")
        except Exception as exc:  # a broken probe must not stop the watcher
            log.warning("probe_failed", service=self.name, source=probe.source, error=repr(exc))
            result = ProbeResult(up=None, reason=f"probe failed: {exc!r}")
        self._latest[probe.source] = result

    async def probe_once(self) -> ServiceObservation:
        """Run every probe once (concurrently), publish and return the merged observation."""
        async with anyio.create_task_group() as tg:
            for probe in self.probes:
                tg.start_soon(self._probe_one, probe)
        self._publish()
        assert self.last is not None
        return self.last

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Probe forever; ready after the first round. Background parts of probes run alongside."""
        async with anyio.create_task_group() as tg:
            for probe in self.probes:
                background = getattr(probe, "run_background", None)
                if background is not None:
                    await tg.start(background)
            await self.probe_once()
            task_status.started()
            while True:
                await anyio.sleep(self.interval_s)
                await self.probe_once()
