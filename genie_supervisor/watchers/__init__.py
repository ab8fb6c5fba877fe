"""Watchers for the neighbour services (whisper, piper, dfn, homeassistant) and the Wyoming proxy.

`build_watchers` turns the config's `services` (`genie_supervisor.config.ServiceConfig`, the one
schema of a watched service) into runnables, each with ``async run(*, task_status)``; start them in
the daemon's task group with ``await tg.start(w.run)``. Every runnable only publishes observations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from anyio.abc import TaskStatus

from genie_supervisor.config_services import ServiceConfig
from genie_supervisor.events import Observation, ServiceObservation

from .base import Probe, ProbeResult, Publish, ServiceWatcher, WaitParked
from .cgroup import CgroupProbe
from .dfn import UnderrunCounter
from .homeassistant import homeassistant_probes
from .http_health import HttpHealthProbe
from .process import GpuMemory, ProcessProbe, ProcessSelector
from .wyoming_proxy import WyomingProxy

__all__ = [
    "ProbeResult",
    "Runnable",
    "ServiceWatcher",
    "WyomingProxy",
    "build_watchers",
]

CGROUP_ROOT = "/sys/fs/cgroup"
"""cgroup v2 mount (tests pass a fake tree as `cgroup_root`)."""
PROC_ROOT = "/proc"
"""procfs mount used by the container lookup (tests pass a fake one as `proc_root`)."""


class Runnable(Protocol):
    """A long-lived watcher task."""

    name: str

    async def run(self, *, task_status: TaskStatus[Any] = ...) -> None: ...


def _probes(s: ServiceConfig, gpu_memory: GpuMemory | None, cgroup_root: str, proc_root: str) -> list[Probe]:
    probes: list[Probe] = []
    m = s.match
    selector = ProcessSelector(m.systemd_unit, m.process_name, m.cmdline_pattern, m.pid_file, cgroup_root=cgroup_root)
    if selector.configured():
        probes.append(ProcessProbe(selector, gpu_memory))
    if s.kind == "homeassistant":
        probes += homeassistant_probes(
            container=m.container,
            cgroup_path=m.cgroup_path,
            health_url=m.health_url,
            token=s.token,
            timeout_s=s.timeout_s,
            cgroup_root=cgroup_root,
            proc_root=proc_root,
        )
        return probes
    if m.container is not None or m.cgroup_path is not None:
        probes.append(
            CgroupProbe(
                cgroup_path=m.cgroup_path,
                container=None if m.cgroup_path else m.container,
                cgroup_root=cgroup_root,
                proc_root=proc_root,
            )
        )
    if m.health_url:
        probes.append(HttpHealthProbe(m.health_url, token=s.token, timeout_s=s.timeout_s))
    if s.log_file or s.journal_unit:
        probes.append(UnderrunCounter(log_file=s.log_file, journal_unit=s.journal_unit))
    return probes


def _runnables(
    name: str, service: ServiceConfig, probes: list[Probe], publish: Publish, wait_parked: WaitParked | None
) -> list[Runnable]:
    out: list[Runnable] = []
    watcher = ServiceWatcher(name, probes, publish, interval_s=service.interval_s) if probes else None
    if watcher is not None:
        out.append(watcher)
    p, voice = service.proxy, service.voice_service
    if p is not None and voice is not None:  # the config allows a proxy only on wyoming_stt / wyoming_tts
        out.append(
            WyomingProxy(
                name,
                *p.listen_address,
                *p.upstream_address,
                voice,
                publish if watcher is None else _merge_into(watcher, publish),
                wait_parked,
                p.hold_audio_stop_until_parked,
                p.hold_max_s,
                health_interval_s=p.health_interval_s,
                idle_timeout_s=p.idle_timeout_s,
                max_connections=p.max_connections,
            )
        )
    return out


def _merge_into(watcher: ServiceWatcher, publish: Publish) -> Publish:
    def proxy_publish(obs: Observation) -> None:
        if isinstance(obs, ServiceObservation):
            watcher.report(
                "wyoming", ProbeResult(up=obs.up, reason=obs.reason, restarts=obs.restarts, counters=obs.counters)
            )
        else:
            publish(obs)

    return proxy_publish


def build_watchers(
    services: Mapping[str, ServiceConfig],
    publish: Publish,
    *,
    wait_parked: WaitParked | None = None,
    gpu_memory: GpuMemory | None = None,
    cgroup_root: str = CGROUP_ROOT,
    proc_root: str = PROC_ROOT,
) -> list[Runnable]:
    """Runnables for every configured service (the config's `services`, by name), in order.

    Each service gets a ServiceWatcher (if it has probes) and a proxy (if set). With both, the
    proxy's upstream health is merged into the service's observation as the ``wyoming`` source;
    its VoiceActivity goes straight to `publish`.
    """
    out: list[Runnable] = []
    for name, service in services.items():
        out += _runnables(name, service, _probes(service, gpu_memory, cgroup_root, proc_root), publish, wait_parked)
    return out
