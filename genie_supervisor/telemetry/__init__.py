"""Platform telemetry: pick a source for this machine and sample it without blocking the loop.

    source = create_source("auto")                       # jetson, nvml or linux, whichever works
    await tg.start(run_sampler, source, store.put, 2.0)  # ready after the first sample

Sources: ``jetson`` (sysfs/hwmon/devfreq/nvpmodel, else jtop when its service runs, else a
running tegrastats), ``nvml`` (desktop NVIDIA), ``linux`` (sysfs thermal + psutil) and
``simulated`` (scriptable). See docs/telemetry.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from genie_supervisor.errors import TelemetryError, TelemetryUnavailable
from genie_supervisor.telemetry.base import TelemetrySource, run_sampler
from genie_supervisor.telemetry.jetson import JetsonSource, not_jetson_reason
from genie_supervisor.telemetry.jtop import JTOP_SOCKET, JtopSource
from genie_supervisor.telemetry.linux import LinuxSource
from genie_supervisor.telemetry.nvml import NvmlSource
from genie_supervisor.telemetry.simulated import SimulatedSource
from genie_supervisor.telemetry.sysfs import under
from genie_supervisor.telemetry.tegrastats import TegrastatsSource, parse_tegrastats

if TYPE_CHECKING:
    from genie_supervisor.config_sections import TelemetryConfig

__all__ = [
    "PLATFORMS",
    "JetsonSource",
    "JtopSource",
    "LinuxSource",
    "NvmlSource",
    "SimulatedSource",
    "TegrastatsSource",
    "TelemetryError",
    "TelemetrySource",
    "TelemetryUnavailable",
    "configured_source",
    "create_source",
    "is_jetson",
    "parse_tegrastats",
    "run_sampler",
]

log = structlog.get_logger(__name__)

PLATFORMS = ("auto", "jetson", "nvml", "linux", "simulated")
"""Accepted values of ``--platform``."""

_JETSON_OPTIONS = frozenset({"nvpmodel_command", "tegrastats_binary", "tegrastats_interval_ms", "jtop_interval_s"})
_NVML_OPTIONS = frozenset({"gpu_index", "nvml"})

Candidate = tuple[str, Callable[[], TelemetrySource]]


def create_source(platform: str = "auto", *, root: str = "/", **options: Any) -> TelemetrySource:
    """Build the telemetry source for `platform` (auto|jetson|nvml|linux|simulated).

    ``auto`` tries jetson (sysfs, then jtop, then tegrastats), nvml, then linux, returns the
    first whose probe passes and logs ``telemetry_selected`` with the reasons the others were
    skipped. An explicitly requested platform that cannot work here raises TelemetryUnavailable
    with the reason. `root` relocates every sysfs/procfs path (tests pass a fake tree).

    Options: jetson takes ``nvpmodel_command``, ``tegrastats_binary``, ``tegrastats_interval_ms``,
    ``jtop_interval_s``; nvml takes ``gpu_index`` (and ``nvml``, a stand-in module for tests);
    simulated takes SimulatedSource's arguments (``script``, ``clock``, ``defaults`` and
    initial TelemetrySample fields).
    """
    if platform not in PLATFORMS:
        raise ValueError(f"unknown telemetry platform {platform!r}; expected one of {PLATFORMS}")
    if platform == "simulated":
        source: TelemetrySource = SimulatedSource(**options)
        log.info("telemetry_selected", platform=source.name, requested=platform, skipped={})
        return source

    known = _JETSON_OPTIONS | _NVML_OPTIONS
    if platform == "jetson":
        known = _JETSON_OPTIONS
    elif platform == "nvml":
        known = _NVML_OPTIONS
    elif platform == "linux":
        known = frozenset()
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for telemetry platform {platform!r}")

    skipped: dict[str, str] = {}
    candidates: list[Candidate] = []
    if platform in ("auto", "jetson"):
        not_jetson = not_jetson_reason(root)
        if not_jetson:
            skipped["jetson"] = not_jetson
        else:
            candidates += _jetson_candidates(root, options)
    if platform in ("auto", "nvml"):
        index = int(options.get("gpu_index", 0))
        candidates.append(("nvml", lambda: NvmlSource(index, root=root, nvml=options.get("nvml"))))
    if platform in ("auto", "linux"):
        candidates.append(("linux", lambda: LinuxSource(root)))

    for name, build in candidates:
        picked, reason = _try(build)
        if picked is None:
            skipped[name] = reason or "unusable"
            continue
        log.info("telemetry_selected", platform=picked.name, requested=platform, skipped=skipped)
        return picked
    detail = "; ".join(f"{name}: {why}" for name, why in skipped.items())
    log.warning("telemetry_unavailable", requested=platform, skipped=skipped)
    raise TelemetryUnavailable(platform, detail or "no candidate source")


def configured_source(tel: TelemetryConfig, platform: str | None = None, *, root: str = "/") -> TelemetrySource:
    """`create_source` for `platform` (default: the configured one); the simulated platform starts
    from the values of ``tel.simulated``."""
    platform = platform or tel.platform
    if platform != "simulated":
        return create_source(platform, root=root)
    sim = tel.simulated
    return create_source(
        "simulated",
        temps_c=dict(sim.temps_c),
        mem_total_mb=sim.mem_total_mb,
        mem_available_mb=sim.mem_available_mb,
        script=sim.script or (),
        loop=sim.loop,
    )


def _try(build: Callable[[], TelemetrySource]) -> tuple[TelemetrySource | None, str | None]:
    """(the source, None) when its probe passes, else (None, the reason)."""
    try:
        source = build()
        reason = source.probe()
    except Exception as exc:  # a broken probe is a reason to skip, not to crash start-up
        return None, f"probe failed: {type(exc).__name__}: {exc}"
    if reason is None:
        return source, None
    source.close()
    return None, reason


def _jetson_candidates(root: str, options: dict[str, Any]) -> list[Candidate]:
    nvpmodel = str(options.get("nvpmodel_command", "nvpmodel"))
    tegrastats = str(options.get("tegrastats_binary", "tegrastats"))
    interval_ms = int(options.get("tegrastats_interval_ms", 1000))
    jtop_interval = float(options.get("jtop_interval_s", 1.0))
    return [
        ("jetson", lambda: JetsonSource(root, nvpmodel_command=nvpmodel)),
        (
            "jetson-jtop",
            lambda: JtopSource(socket_path=under(root, JTOP_SOCKET), interval_s=jtop_interval),
        ),
        ("jetson-tegrastats", lambda: TegrastatsSource(binary=tegrastats, interval_ms=interval_ms)),
    ]


def is_jetson(root: str = "/") -> bool:
    """True when `root` looks like a Jetson (L4T release file or device-tree model)."""
    return not_jetson_reason(root) is None
