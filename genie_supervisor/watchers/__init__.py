"""Watchers for the neighbour services (whisper, piper, dfn, homeassistant) and the Wyoming proxy.

`build_watchers` turns plain settings (`WatcherSettings`, or dicts with the same keys) into
runnables, each with ``async run(*, task_status)``; start them in the daemon's task group with
``await tg.start(w.run)``. Every runnable only publishes observations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from anyio.abc import TaskStatus

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
    "ProxySettings",
    "Runnable",
    "ServiceWatcher",
    "WatcherSettings",
    "WyomingProxy",
    "build_watcher",
    "build_watchers",
]

Kind = Literal["whisper", "piper", "dfn", "homeassistant", "generic"]
_PROXY_SERVICE: dict[str, Literal["stt", "tts"]] = {"whisper": "stt", "piper": "tts"}


@dataclass(frozen=True)
class ProxySettings:
    """A Wyoming proxy in front of a service (Home Assistant connects to `listen_port`)."""

    upstream_port: int
    """Port of the real Wyoming server."""
    listen_port: int
    """Port the proxy listens on (0 picks a free one)."""
    upstream_host: str = "127.0.0.1"
    """Host of the real Wyoming server."""
    listen_host: str = "127.0.0.1"
    """Address the proxy binds: loopback by default (Home Assistant on the same box, or in Docker
    with host networking); ``0.0.0.0`` or a LAN address only for Home Assistant on another host."""
    service: Literal["stt", "tts"] | None = None
    """``stt`` or ``tts``; None takes it from the kind (whisper: stt, piper: tts)."""
    hold_audio_stop_until_parked: bool = True
    """Forward `audio-stop` only once the engine is parked (STT only)."""
    hold_max_s: float = 0.5
    """Longest hold of `audio-stop` in seconds."""
    health_interval_s: float | None = 5.0
    """Seconds between `describe` probes of the upstream (None: no probes)."""
    health_timeout_s: float = 1.0
    """Deadline for the `info` answer."""
    idle_timeout_s: float = 90.0
    """A connection with no complete client event and no server bytes for this long is closed."""
    max_connections: int = 32
    """Client connections open at once; more are refused with a Wyoming `error` event."""


@dataclass(frozen=True)
class WatcherSettings:
    """How to watch one service; every locator is optional and they combine."""

    name: str
    """Service name in observations (``whisper``, ``piper``, ``dfn``, ``homeassistant``)."""
    kind: Kind = "generic"
    """Which defaults apply: whisper/piper take a proxy's service from it, dfn counts underruns,
    homeassistant uses cgroup memory and ``/api/`` health."""
    systemd_unit: str | None = None
    """systemd unit whose cgroup holds the processes."""
    process_name: str | None = None
    """Executable name (psutil name() or basename of argv[0])."""
    cmdline_pattern: str | None = None
    """Regular expression searched in the command line."""
    pid_file: str | None = None
    """File holding the main pid."""
    container: str | None = None
    """Container id prefix, hostname or command-line word (see watchers.cgroup)."""
    cgroup_path: str | None = None
    """cgroup v2 directory to read memory from."""
    health_url: str | None = None
    """URL for an HTTP health check (e.g. ``http://127.0.0.1:8123/api/``)."""
    token: str | None = None
    """Bearer token for the health URL (Home Assistant long-lived access token)."""
    log_file: str | None = None
    """Log file to count DFN underruns in."""
    journal_unit: str | None = None
    """systemd unit whose journal to follow for DFN underruns."""
    interval_s: float = 2.0
    """Seconds between probes."""
    timeout_s: float = 2.0
    """Deadline of one HTTP health check."""
    cgroup_root: str = "/sys/fs/cgroup"
    """cgroup v2 mount (tests inject a fake tree)."""
    proc_root: str = "/proc"
    """procfs mount used by the container lookup."""
    proxy: ProxySettings | None = None
    """A Wyoming proxy in front of this service."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> WatcherSettings:
        """Build from a plain dict (a nested ``proxy`` dict too); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"watcher {values.get('name')!r}: unknown keys {unknown}")
        values = dict(values)
        proxy = values.get("proxy")
        if isinstance(proxy, Mapping):
            proxy_known = {f.name for f in dataclasses.fields(ProxySettings)}
            bad = sorted(set(proxy) - proxy_known)
            if bad:
                raise ValueError(f"watcher {values.get('name')!r}: unknown proxy keys {bad}")
            values["proxy"] = ProxySettings(**proxy)
        return cls(**values)


class Runnable(Protocol):
    """A long-lived watcher task."""

    name: str

    async def run(self, *, task_status: TaskStatus[Any] = ...) -> None: ...


def _probes(s: WatcherSettings, gpu_memory: GpuMemory | None) -> list[Probe]:
    probes: list[Probe] = []
    selector = ProcessSelector(s.systemd_unit, s.process_name, s.cmdline_pattern, s.pid_file, cgroup_root=s.cgroup_root)
    if selector.configured():
        probes.append(ProcessProbe(selector, gpu_memory))
    if s.kind == "homeassistant":
        probes += homeassistant_probes(
            container=s.container,
            cgroup_path=s.cgroup_path,
            health_url=s.health_url,
            token=s.token,
            timeout_s=s.timeout_s,
            cgroup_root=s.cgroup_root,
            proc_root=s.proc_root,
        )
        return probes
    if s.container is not None or s.cgroup_path is not None:
        probes.append(
            CgroupProbe(
                cgroup_path=s.cgroup_path,
                container=None if s.cgroup_path else s.container,
                cgroup_root=s.cgroup_root,
                proc_root=s.proc_root,
            )
        )
    if s.health_url:
        probes.append(HttpHealthProbe(s.health_url, token=s.token, timeout_s=s.timeout_s))
    if s.log_file or s.journal_unit:
        probes.append(UnderrunCounter(log_file=s.log_file, journal_unit=s.journal_unit))
    return probes


def build_watcher(
    settings: WatcherSettings | Mapping[str, Any],
    publish: Publish,
    *,
    wait_parked: WaitParked | None = None,
    gpu_memory: GpuMemory | None = None,
) -> list[Runnable]:
    """The runnables for one service: a ServiceWatcher (if it has probes) and a proxy (if set).

    With both, the proxy's upstream health is merged into the service's observation as the
    ``wyoming`` source; its VoiceActivity goes straight to `publish`.
    """
    s = settings if isinstance(settings, WatcherSettings) else WatcherSettings.from_mapping(settings)
    probes = _probes(s, gpu_memory)
    out: list[Runnable] = []
    watcher = ServiceWatcher(s.name, probes, publish, interval_s=s.interval_s) if probes else None
    if watcher is not None:
        out.append(watcher)
    if s.proxy is not None:
        p = s.proxy
        service: Literal["stt", "tts"] | None = p.service or _PROXY_SERVICE.get(s.kind)
        if service is None:
            raise ValueError(f"watcher {s.name!r}: proxy.service must be stt or tts for kind {s.kind!r}")
        proxy_publish = publish if watcher is None else _merge_into(watcher, publish)
        out.append(
            WyomingProxy(
                s.name,
                p.listen_host,
                p.listen_port,
                p.upstream_host,
                p.upstream_port,
                service,
                proxy_publish,
                wait_parked,
                p.hold_audio_stop_until_parked,
                p.hold_max_s,
                health_interval_s=p.health_interval_s,
                health_timeout_s=p.health_timeout_s,
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
    settings: Iterable[WatcherSettings | Mapping[str, Any]],
    publish: Publish,
    *,
    wait_parked: WaitParked | None = None,
    gpu_memory: GpuMemory | None = None,
) -> list[Runnable]:
    """Runnables for every configured service, in order."""
    out: list[Runnable] = []
    for s in settings:
        out += build_watcher(s, publish, wait_parked=wait_parked, gpu_memory=gpu_memory)
    return out
