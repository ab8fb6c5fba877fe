"""`genie-supervisor policy check FILE...` and `policy simulate FILE --trace TRACE.jsonl [--plot PNG]`.

A trace is JSONL, one observation a line: ``{"t": seconds, "type": "telemetry"|"service"|"voice"|
"engine", ...fields of that dataclass}``; ``{"t": s, "type": "tick"}`` only advances time and
``{"type": "meta", "stt_services": [...], "hint_timeout_s": s}`` sets up the store.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, TextIO

from ..errors import PolicyErrors
from ..events import EngineStats, Observation, ServiceObservation, TelemetrySample, VoiceActivity
from ..state import Decision, StateStore
from .evaluate import evaluate
from .loader import load_policy
from .schema import Policy

_TYPES: dict[str, type[Any]] = {
    "telemetry": TelemetrySample,
    "service": ServiceObservation,
    "voice": VoiceActivity,
    "engine": EngineStats,
}
_TUPLES = {"pids"}


def cmd_policy(args: argparse.Namespace) -> int:
    """Entry point of the `policy` subcommand."""
    if args.policy_command == "check":
        return check(args.files, sys.stdout)
    return simulate(args.file, args.trace, args.plot, sys.stdout)


def check(files: list[str], out: TextIO) -> int:
    """Validate each file; print ``file: ok ...`` or its ``file:line key: message`` lines."""
    failed = False
    for name in files:
        try:
            policy = load_policy(name)
        except PolicyErrors as exc:
            failed = True
            for issue in exc.issues:
                print(issue.format(), file=out)
            continue
        print(f"{name}: ok (policy {policy.name!r}, version {policy.version})", file=out)
    return 1 if failed else 0


class TraceError(ValueError):
    """A bad trace line: ``file:line: message``."""


@dataclasses.dataclass
class Trace:
    """A parsed trace."""

    events: list[tuple[float, Observation | None]]
    stt_services: list[str]
    hint_timeout_s: float | None


def parse_trace(path: str) -> Trace:
    """Read a JSONL trace into (t, observation) pairs in time order; raises TraceError."""
    trace = Trace([], [], None)
    last = float("-inf")
    with open(path, encoding="utf-8") as fh:
        for n, raw in enumerate(fh, 1):
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(raw)
            except ValueError as exc:
                raise TraceError(f"{where}: not JSON: {exc}") from exc
            if not isinstance(rec, dict):
                raise TraceError(f"{where}: expected a JSON object")
            kind = rec.pop("type", None)
            if kind == "meta":
                trace.stt_services = list(rec.get("stt_services", []))
                trace.hint_timeout_s = rec.get("hint_timeout_s")
                continue
            t = rec.pop("t", None)
            if not isinstance(t, (int, float)):
                raise TraceError(f"{where}: t must be a number of seconds, got {t!r}")
            if t < last:
                raise TraceError(f"{where}: t ({t}) goes back in time (previous {last})")
            last = float(t)
            if kind == "tick":
                trace.events.append((float(t), None))
                continue
            cls = _TYPES.get(str(kind))
            if cls is None:
                raise TraceError(f"{where}: type must be one of {', '.join([*_TYPES, 'tick', 'meta'])}, got {kind!r}")
            trace.events.append((float(t), _build(cls, rec, float(t), where)))
    return trace


def _build(cls: type[Any], rec: dict[str, Any], t: float, where: str) -> Observation:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(rec) - names)
    if unknown:
        raise TraceError(
            f"{where}: unknown field {unknown[0]!r} for {cls.__name__}; expected {', '.join(sorted(names - {'ts'}))}"
        )
    if "trip_points_c" in rec:
        rec["trip_points_c"] = {k: tuple(v) for k, v in rec["trip_points_c"].items()}
    for key in _TUPLES & set(rec):
        rec[key] = tuple(rec[key])
    if cls is VoiceActivity:
        rec.setdefault("source", "trace")
    try:
        obs: Observation = cls(**{**rec, "ts": t})
    except TypeError as exc:
        raise TraceError(f"{where}: {exc}") from exc
    return obs


def run_trace(policy: Policy, trace: Trace) -> list[tuple[float, Decision, dict[str, float | None]]]:
    """Evaluate `policy` over `trace`; returns (t, decision, plotted inputs) at every change."""
    start = trace.events[0][0] if trace.events else 0.0
    clock = [start]
    timeout = policy.voice.hint_timeout_s or trace.hint_timeout_s or 30.0
    store = StateStore(hint_timeout_s=timeout, stt_services=trace.stt_services, clock=lambda: clock[0])
    out: list[tuple[float, Decision, dict[str, float | None]]] = []
    prev: Decision | None = None

    def step(t: float) -> None:
        nonlocal prev
        clock[0] = t
        store.expire(t)
        snap = store.snapshot()
        d = evaluate(policy, snap, prev)
        if prev is None or d.effect() != prev.effect():
            tel = snap.telemetry
            temps = tel.temps_c if tel else {}
            sensor = policy.thermal.sensor
            temp = max(temps.values(), default=None) if sensor == "max" else temps.get(sensor)
            out.append((t, d, {"temp_c": temp, "mem_available_mb": tel.mem_available_mb if tel else None}))
        prev = d

    def drain(until: float) -> None:
        for _ in range(10000):
            pending = [
                x
                for x in (prev.next_eval_at if prev else None, store.snapshot().voice.hint_expires_at)
                if x is not None and x <= until
            ]
            if not pending:
                return
            step(min(pending))

    for t, obs in trace.events:
        drain(t)
        clock[0] = t
        if obs is not None:
            store.publish(obs)
        step(t)
    return out


def simulate(file: str, trace_path: str, plot: str | None, out: TextIO) -> int:
    """Print the decision timeline of `file` over the trace; optionally plot it."""
    try:
        policy = load_policy(file)
        trace = parse_trace(trace_path)
    except PolicyErrors as exc:
        print(str(exc), file=out)
        return 1
    except (TraceError, OSError) as exc:
        print(f"error: {exc}", file=out)
        return 1
    timeline = run_trace(policy, trace)
    print(f"policy {policy.name!r} ({file}) over {trace_path}: {len(trace.events)} events", file=out)
    for t, d, _ in timeline:
        rules = "; ".join(f"{f.rule} {json.dumps(dict(f.inputs), sort_keys=True)}" for f in d.fired) or "no rule"
        print(f"{t:10.3f}s  {d.action_text():<40} <- {rules}", file=out)
    end = trace.events[-1][0] if trace.events else 0.0
    totals: dict[str, float] = {}
    for (t, d, _), nxt in zip(timeline, [*(x[0] for x in timeline[1:]), end], strict=True):
        totals[d.gate] = totals.get(d.gate, 0.0) + max(0.0, nxt - t)
    print("time per gate mode: " + ", ".join(f"{k} {v:.3f}s" for k, v in sorted(totals.items())), file=out)
    if plot:
        return _plot(timeline, end, plot, policy.name, out)
    return 0


def _plot(
    timeline: list[tuple[float, Decision, dict[str, float | None]]], end: float, png: str, name: str, out: TextIO
) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: --plot needs matplotlib (pip install 'genie-supervisor[plot]')", file=out)
        return 1
    ts = [t for t, _, _ in timeline] + [end]
    level = {"open": 0, "throttled": 1, "paused": 2}
    gate = [level[d.gate] for _, d, _ in timeline]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(10, 5))
    ax1.step(ts, [*gate, gate[-1]] if gate else [0], where="post")
    ax1.set_yticks([0, 1, 2], ["open", "throttled", "paused"])
    ax1.set_title(f"policy {name}: decode gate")
    temps = [x["temp_c"] for _, _, x in timeline]
    if any(v is not None for v in temps):
        ax2.step(ts[:-1], [float("nan") if v is None else v for v in temps], where="post", label="temp °C")
    mem = [x["mem_available_mb"] for _, _, x in timeline]
    if any(v is not None for v in mem):
        ax3 = ax2.twinx()
        ax3.step(ts[:-1], [float("nan") if v is None else v for v in mem], where="post", color="tab:green")
        ax3.set_ylabel("MemAvailable MiB")
    ax2.set_ylabel("°C")
    ax2.set_xlabel("t (s)")
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    print(f"plot written to {png}", file=out)
    return 0
