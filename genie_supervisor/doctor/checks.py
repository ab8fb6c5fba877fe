"""The doctor's checks: small functions that look at one thing and return `Check`s.

Each takes what it inspects as arguments (a config, a policy, a telemetry sample, a probe
function), so tests drive them without the real machine. `fail` means the daemon would not start
(or not load its model); `warn` means it starts but something it watches or talks to is missing.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from ..config import Config, ServiceConfig, load_config, parse_hostport
from ..errors import ConfigErrors, PolicyErrors
from ..events import TelemetrySample
from ..policy import Policy, load_policy
from ..policy.schema import builtin_policy
from ..telemetry.jetson import jetson_model
from ..telemetry.sysfs import read_text, under
from ..watchers.process import ProcessSelector, find_pids

MiB = 1024 * 1024

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    """The verdict on one thing the daemon needs."""

    name: str
    """What was checked (``config``, ``model``, ``service whisper``, ...)."""
    status: Status
    """``ok``; ``warn``: starts, but something is missing; ``fail``: would not start."""
    detail: str
    """What was seen, with the numbers."""
    fix: str = ""
    """What to do about it (empty when nothing needs doing)."""


# --- config and policy -------------------------------------------------------------------------


def check_config(path: str | None, overrides: dict[str, str | None]) -> tuple[Check, Config | None]:
    """Load the daemon config as `run` would (same overrides); fail with file:line errors."""
    where = path or "built-in defaults"
    try:
        cfg = load_config(path, overrides)
    except ConfigErrors as exc:
        return Check(
            "config", "fail", f"{where}: invalid\n{exc}", "fix the lines above (every key: docs/configuration.md)"
        ), None
    detail = (
        f"{where}: node {cfg.node_id}, API {cfg.http.listen}, {len(cfg.services)} service(s), "
        f"platform {cfg.telemetry.platform}"
    )
    return Check("config", "ok", detail), cfg


def check_policy(cfg: Config) -> tuple[Check, Policy | None]:
    """Load the policy file the config names (or the built-in policy)."""
    if cfg.policy.path is None:
        policy = builtin_policy()
        return Check("policy", "ok", f"built-in ({policy.memory.llm_budget_mb:.0f} MiB LLM budget)"), policy
    try:
        policy = load_policy(cfg.policy.path)
    except PolicyErrors as exc:
        return Check(
            "policy",
            "fail",
            f"{cfg.policy.path}: invalid\n{exc}",
            f"genie-supervisor policy check {cfg.policy.path}; reference: docs/policy.md",
        ), None
    return Check(
        "policy", "ok", f"{policy.name} ({cfg.policy.path}), LLM budget {policy.memory.llm_budget_mb:.0f} MiB"
    ), policy


# --- platform ----------------------------------------------------------------------------------

_L4T = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)")
JETPACK_OF_L4T = {32: "4", 34: "5", 35: "5", 36: "6"}
"""L4T major release -> JetPack major version."""


def l4t_release(root: str = "/") -> tuple[int, str] | None:
    """(major, "R36.3.0") from /etc/nv_tegra_release, None when absent or unreadable."""
    text = read_text(under(root, "/etc/nv_tegra_release"))
    m = _L4T.search(text or "")
    return (int(m.group(1)), f"R{m.group(1)}.{m.group(2)}") if m else None


def describe_board(root: str = "/") -> str:
    """One line: the board, its L4T and JetPack release when it is a Jetson."""
    model = jetson_model(root)
    release = l4t_release(root)
    if release is None:
        return f"{model or 'unknown board'} (no /etc/nv_tegra_release: not a Jetson)"
    major, name = release
    jetpack = JETPACK_OF_L4T.get(major)
    return f"{model or 'Jetson'}, L4T {name}" + (f" (JetPack {jetpack})" if jetpack else "")


def check_telemetry(
    configured: str, usable: dict[str, str | None], chosen: str | None, source_name: str | None = None
) -> Check:
    """Which telemetry source the daemon would use. `usable` maps each platform tried to None
    (works) or why it does not; `chosen` is the platform a sample came from (None: none works),
    `source_name` the source inside it (``jetson-tegrastats``)."""
    others = "; ".join(
        f"{name}: {_unprefixed(why, name) if why else 'works'}" for name, why in usable.items() if name != chosen
    )
    if chosen is None:
        return Check(
            "telemetry",
            "fail",
            f"platform {configured}: nothing usable ({others})",
            "set telemetry.platform to one that works here (auto picks one), or fix the "
            "reason above (docs/telemetry.md)",
        )
    detail = source_name or chosen
    if configured != chosen:
        detail += f" (platform {configured})"
    return Check("telemetry", "ok", detail + (f"; others: {others}" if others else ""))


def _unprefixed(reason: str, name: str) -> str:
    return reason[len(name) + 2 :] if reason.startswith(f"{name}: ") else reason


def check_cuda(backend: str, cuda: tuple[bool, str], on_jetson: bool) -> Check:
    """Whether the engine's backend can run here: `cuda` is engine.backends.cuda_available()."""
    ok, why = cuda
    if backend == "numpy":
        return Check("cuda", "ok", f"not used (engine.backend numpy); CUDA: {why}")
    if ok:
        return Check("cuda", "ok", f"usable: {why}; engine.backend {backend} runs on CuPy")
    if backend == "cupy":
        return Check(
            "cuda",
            "fail",
            f"engine.backend cupy, but CUDA is not usable: {why}",
            "install CuPy for CUDA 12 (pip install 'genie-supervisor[cuda]') and check "
            "that the daemon's user is in the video group, or set engine.backend: numpy",
        )
    if on_jetson:
        return Check(
            "cuda",
            "warn",
            f"not usable, engine.backend auto falls back to NumPy on the CPU: {why}",
            "install CuPy into the venv (pip install 'genie-supervisor[cuda]'); JetPack's CUDA "
            "must be in /usr/local/cuda",
        )
    return Check("cuda", "ok", f"not usable, engine.backend auto runs on NumPy: {why}")


# --- services ----------------------------------------------------------------------------------

ProbeTcp = Callable[[str, int], tuple[bool, str]]
"""(host, port) -> (answers, reason); e.g. a Wyoming `describe` round trip."""
ProbeHttp = Callable[[str, "str | None"], tuple[bool, str]]
"""(url, bearer token) -> (healthy, reason)."""


def port_free(host: str, port: int) -> tuple[bool, str]:
    """Whether this process could listen on host:port now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return False, exc.strerror or str(exc)
    return True, "free"


def check_service(
    name: str,
    svc: ServiceConfig,
    *,
    cgroup_root: str,
    wyoming: ProbeTcp,
    http: ProbeHttp,
    bindable: ProbeTcp = port_free,
) -> Check:
    """Is a configured neighbour there: its processes, its Wyoming server, its health URL."""
    seen: list[str] = []
    missing: list[str] = []
    match = svc.match
    selector = ProcessSelector(
        systemd_unit=match.systemd_unit,
        process_name=match.process_name,
        cmdline_pattern=match.cmdline_pattern,
        pid_file=match.pid_file,
        cgroup_root=cgroup_root,
    )
    if selector.configured():
        pids = find_pids(selector)
        (seen if pids else missing).append(
            f"{len(pids)} process(es)" if pids else f"no process ({selector.describe()})"
        )
    if svc.proxy is not None:
        host, port = parse_hostport(svc.proxy.upstream)
        up, why = wyoming(host, port)
        (seen if up else missing).append(f"upstream {svc.proxy.upstream} {'answers' if up else why}")
        lhost, lport = parse_hostport(svc.proxy.listen)
        free, why = bindable(lhost, lport)
        if not free:
            missing.append(f"proxy port {svc.proxy.listen} taken ({why})")
    if match.health_url:
        up, why = http(match.health_url, svc.token)
        (seen if up else missing).append(f"{match.health_url} {why}")
    if match.container and not (selector.configured() or match.health_url):
        seen.append(f"container {match.container} (not inspected)")
    detail = f"{svc.kind}: " + ", ".join(seen + missing)
    if not missing:
        return Check(f"service {name}", "ok", detail)
    return Check(f"service {name}", "warn", detail, _service_fix(name, svc, missing))


def _service_fix(name: str, svc: ServiceConfig, missing: list[str]) -> str:
    fixes = []
    if any(m.startswith("no process") for m in missing):
        unit = svc.match.systemd_unit
        fixes.append(f"start it (systemctl start {unit})" if unit else f"start it, or fix services.{name}.match")
    if any(m.startswith("upstream") for m in missing) and svc.proxy is not None:
        fixes.append(f"make the server listen on {svc.proxy.upstream} (its --uri tcp://{svc.proxy.upstream})")
    if any(m.startswith("proxy port") for m in missing) and svc.proxy is not None:
        fixes.append(
            f"unless genie-supervisor is already running, free {svc.proxy.listen}: the "
            "Wyoming server must move to the upstream port"
        )
    if svc.match.health_url and any(m.startswith(svc.match.health_url) for m in missing):
        fixes.append("check match.health_url and the service")
    return "; ".join(fixes)


def check_http(listen: str, bindable: ProbeTcp = port_free) -> Check:
    """Can the API bind its address (taken: another program, or the daemon already runs)."""
    host, port = parse_hostport(listen)
    free, why = bindable(host, port)
    if free:
        return Check("http", "ok", f"{listen} is free to listen on")
    return Check(
        "http",
        "warn",
        f"{listen} cannot be bound now: {why}",
        "fine if genie-supervisor is already running (systemctl status genie-supervisor); "
        "otherwise change http.listen or stop what holds the port (ss -ltnp)",
    )


def check_api_access(cfg: Config) -> Check:
    """Is the API reachable beyond loopback without a key (anyone on the LAN could unload the model)?"""
    host, _port = parse_hostport(cfg.http.listen)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() == "localhost"
    keyed = cfg.api.key() is not None
    how = "key required" if keyed else "no key"
    cors = f", CORS for {', '.join(cfg.http.cors_origins)}" if cfg.http.cors_origins else ""
    if loopback or keyed:
        where = "loopback only" if loopback else f"beyond loopback ({cfg.http.listen})"
        return Check("api access", "ok", f"{where}, {how}{cors}")
    return Check(
        "api access",
        "warn",
        f"the API listens beyond loopback ({cfg.http.listen}) without a key: anyone who can reach "
        f"it can unload the model, pause the LLM and read /status{cors}",
        "set api.api_key_file (deploy/setup-jetson.sh creates /etc/genie-supervisor/api-key), "
        "or listen on 127.0.0.1 (docs/security.md)",
    )


# --- thermal -----------------------------------------------------------------------------------


def check_thermal(sample: TelemetrySample | None, policy: Policy) -> Check:
    """Temperatures and kernel trip points now, and whether the policy acts before the kernel does."""
    if sample is None:
        return Check("thermal", "warn", "no telemetry sample", "see the telemetry line")
    temps = ", ".join(f"{k} {v:.0f}" for k, v in sorted(sample.temps_c.items())) or "no sensors"
    trips = {k: v for k, v in sample.trip_points_c.items() if v}
    trip_text = ", ".join(f"{k} {'/'.join(f'{t:.0f}' for t in v)}" for k, v in sorted(trips.items()))
    detail = f"{temps} °C; trip points " + (f"{trip_text} °C" if trips else "not reported")
    levels = policy.thermal.levels
    if not levels:
        return Check("thermal", "ok", detail + "; policy has no thermal levels")
    sensor = policy.thermal.sensor
    relevant: Iterable[tuple[float, ...]] = trips.values() if sensor == "max" else [trips.get(sensor, ())]
    lowest = min((min(v) for v in relevant if v), default=None)
    hottest = levels[-1]
    detail += f"; policy {hottest.name} at {hottest.enter_c:g} °C"
    if lowest is not None and hottest.enter_c >= lowest:
        return Check(
            "thermal",
            "warn",
            detail + f" is not below the kernel's first trip ({lowest:g} °C)",
            "lower the policy's thermal levels below the trip point, or the kernel "
            "throttles whisper along with the LLM first",
        )
    if sensor != "max" and sensor not in sample.temps_c:
        return Check(
            "thermal",
            "warn",
            detail + f"; sensor {sensor!r} not reported",
            f"set thermal.sensor to one of {sorted(sample.temps_c)} or max",
        )
    return Check("thermal", "ok", detail)
