"""`genie-supervisor doctor`: one screen that says whether this box will run the daemon.

    checks = audit("/etc/genie-supervisor/supervisor.yaml")   # list[Check]
    print(render(checks)); exit_code(checks, strict=False)

The board and which telemetry source works (and why the others do not), CUDA, each configured
service, the broker (TCP + MQTT CONNECT), the model with its memory plan against the policy's
budget and the box's memory, thermal trip points. Exit status 1 when something would stop the
daemon at start-up (bad config or policy, model missing or over budget, the configured platform
unusable); warnings (broker down, a service not found) fail only with ``--strict``.
Everything the checks touch is injectable (`Probes`), so tests run them on a simulated box.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from engine import open_model_file
from engine.backends import cuda_available

from ..config import Config
from ..errors import TelemetryUnavailable
from ..events import TelemetrySample
from ..logging import configure_logging
from ..telemetry import TelemetrySource, configured_source, is_jetson
from ..watchers.http_health import HttpHealthProbe
from ..watchers.wyoming_connection import probe_wyoming
from .broker import check_broker, mqtt_ping
from .checks import (
    Check,
    ProbeHttp,
    ProbeTcp,
    check_api_access,
    check_config,
    check_cuda,
    check_http,
    check_policy,
    check_service,
    check_telemetry,
    check_thermal,
    describe_board,
    port_free,
)
from .memory import OpenModel, check_model

__all__ = ["Check", "Probes", "audit", "cmd_doctor", "exit_code", "render"]

SourceFactory = Callable[[str], TelemetrySource]
"""Builds the telemetry source of one platform; raises TelemetryUnavailable when it cannot work."""
REAL_PLATFORMS = ("jetson", "nvml", "linux")


def _wyoming(host: str, port: int) -> tuple[bool, str]:
    return anyio.run(probe_wyoming, host, port, 1.0)


def _http(url: str, token: str | None) -> tuple[bool, str]:
    result = anyio.run(HttpHealthProbe(url, token=token, timeout_s=2.0).probe)
    return bool(result.up), result.reason


@dataclass
class Probes:
    """What the audit touches outside the config; tests replace any of it."""

    root: str = "/"
    """Filesystem root for /sys, /proc and /etc reads (a fake tree in tests)."""
    sources: SourceFactory | None = None
    """Telemetry source per platform (default: configured_source)."""
    cuda: Callable[[], tuple[bool, str]] = cuda_available
    """Whether CUDA works, and why not."""
    broker: Callable[[Config], tuple[bool, str]] = field(
        default=lambda cfg: mqtt_ping(
            cfg.mqtt.url or "",
            username=cfg.mqtt.username,
            password=cfg.mqtt.password,
            tls=cfg.mqtt.tls,
            ca_file=cfg.mqtt.ca_file,
            cert_file=cfg.mqtt.cert_file,
            key_file=cfg.mqtt.key_file,
            timeout_s=2.0,
        )
    )
    """MQTT CONNECT round trip to the configured broker."""
    wyoming: ProbeTcp = _wyoming
    """Wyoming `describe` round trip to a proxy's upstream."""
    http: ProbeHttp = _http
    """Health URL check."""
    bindable: ProbeTcp = port_free
    """Whether a listen address is free."""
    open_model: OpenModel = open_model_file
    """GGUF header reader."""
    cgroup_root: str | None = None
    """cgroup v2 root for systemd_unit matches (default <root>/sys/fs/cgroup)."""


def _default_sources(cfg: Config, root: str) -> SourceFactory:
    def build(platform: str) -> TelemetrySource:
        return configured_source(cfg.telemetry, platform, root=root)

    return build


def sample_telemetry(configured: str, build: SourceFactory) -> tuple[Check, TelemetrySample | None]:
    """Try every platform (the configured one first when simulated); sample the one the daemon
    would pick: the configured platform, or with auto the first that works (jetson, nvml, linux)."""
    names = (["simulated"] if configured == "simulated" else []) + list(REAL_PLATFORMS)
    usable: dict[str, str | None] = {}
    chosen: str | None = None
    source_name: str | None = None
    sample: TelemetrySample | None = None
    for name in names:
        try:
            source = build(name)
        except TelemetryUnavailable as exc:
            usable[name] = exc.reason
            continue
        except Exception as exc:  # a broken probe is a finding, not a crash of the doctor
            usable[name] = f"{type(exc).__name__}: {exc}"
            continue
        try:
            usable[name] = None
            if chosen is None and configured in ("auto", name):
                try:
                    sample = source.sample()
                    chosen, source_name = name, source.name
                except Exception as exc:
                    usable[name] = f"sample failed: {type(exc).__name__}: {exc}"
        finally:
            source.close()
    return check_telemetry(configured, usable, chosen, source_name), sample


def audit(
    config_path: str | None, overrides: dict[str, Any] | None = None, probes: Probes | None = None
) -> list[Check]:
    """Run every check against the config (with `run`'s CLI overrides) and return them in order."""
    probes = probes or Probes()
    checks = [Check("board", "ok", describe_board(probes.root))]
    config_check, cfg = check_config(config_path, overrides or {})
    checks.append(config_check)
    if cfg is None:
        return checks
    policy_check, policy = check_policy(cfg)
    checks.append(policy_check)
    build = probes.sources or _default_sources(cfg, probes.root)
    telemetry_check, sample = sample_telemetry(cfg.telemetry.platform, build)
    checks.append(telemetry_check)
    checks.append(check_cuda(cfg.engine.backend, probes.cuda(), is_jetson(probes.root)))
    if policy is not None:
        checks += check_model(cfg, policy, sample, probes.open_model)
        checks.append(check_thermal(sample, policy))
    checks.append(check_http(cfg.http.listen, probes.bindable))
    checks.append(check_api_access(cfg))
    checks.append(check_broker(cfg.mqtt.url, probes.broker(cfg) if cfg.mqtt.url else None))
    cgroup_root = probes.cgroup_root or f"{probes.root.rstrip('/')}/sys/fs/cgroup"
    for name, svc in cfg.services.items():
        checks.append(
            check_service(
                name, svc, cgroup_root=cgroup_root, wyoming=probes.wyoming, http=probes.http, bindable=probes.bindable
            )
        )
    return checks


def exit_code(checks: list[Check], *, strict: bool = False) -> int:
    """1 when a check failed (or, with `strict`, warned), else 0."""
    bad = {"fail", "warn"} if strict else {"fail"}
    return 1 if any(c.status in bad for c in checks) else 0


def verdict(checks: list[Check], *, strict: bool = False) -> str:
    """One line: would the daemon start, and how many problems."""
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    counts = f"{fails} failure(s), {warns} warning(s)"
    if fails:
        return f"verdict: the daemon would NOT start ({counts})"
    if warns and strict:
        return f"verdict: warnings are failures with --strict ({counts})"
    return f"verdict: the daemon would start ({counts})" if warns else "verdict: all good"


_MARK = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}


def render(
    checks: list[Check], *, title: str = "genie-supervisor doctor", width: int = 100, strict: bool = False
) -> str:
    """The one-screen report: a line per check, then each problem with its fix, then the verdict."""
    lines = [title]
    for c in checks:
        head = f"  {_MARK[c.status]} {c.name:<22} "
        first, *rest = c.detail.splitlines() or [""]
        lines.append(textwrap.fill(first, width, initial_indent=head, subsequent_indent=" " * len(head)))
        lines += [" " * len(head) + extra for extra in rest]
    problems = [c for c in checks if c.status != "ok" and c.fix]
    if problems:
        lines.append("fixes:")
        for c in problems:
            lines.append(textwrap.fill(c.fix, width, initial_indent=f"  {c.name}: ", subsequent_indent="    "))
    lines.append(verdict(checks, strict=strict))
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    """CLI entry: audit, print the report (or JSON), exit 1 on failures (warnings with --strict)."""
    configure_logging(level="error", fmt="console", stream=sys.stderr)
    overrides = {key: getattr(args, key, None) for key in ("model", "policy", "mqtt", "listen", "platform")}
    probes = Probes(root=getattr(args, "root", None) or "/")
    checks = audit(getattr(args, "config", None), overrides, probes)
    strict = bool(getattr(args, "strict", False))
    code = exit_code(checks, strict=strict)
    if getattr(args, "json", False):
        print(
            json.dumps(
                {"checks": [asdict(c) for c in checks], "verdict": verdict(checks, strict=strict), "exit": code},
                indent=2,
            )
        )
    else:
        title = f"genie-supervisor doctor (config: {getattr(args, 'config', None) or 'built-in defaults'})"
        print(render(checks, title=title, strict=strict))
    return code
