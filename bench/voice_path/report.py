"""From raw runs to figures: the summary per scenario, the Markdown table, the timeline plot."""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.record import record

from .utterances import wer

SCENARIOS = ("idle", "contention", "arbitration")


def pct(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1); None for no values."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


PHASES = ("decode", "prefill", "idle")


def reactions_by_phase(gate_log: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Pause reaction times (ms) split by what the engine was running when the pause came: the
    kind of the last step it was let through (the daemon's `decode_parked` `after`), or `idle`
    when no generation was running (`decode_paused` `generations` 0: nothing had to stop; a later
    request parks at its first step, which is no reaction time and is left out)."""
    out: dict[str, list[float]] = {}
    idle_pause = False
    for e in sorted(gate_log, key=lambda e: e["t"]):
        if e["event"] == "decode_paused":
            idle_pause = not e.get("generations")
            if idle_pause:
                out.setdefault("idle", [])
        elif e["event"] == "decode_parked" and e.get("reaction_ms") is not None and not idle_pause:
            out.setdefault(str(e.get("after") or "unknown"), []).append(float(e["reaction_ms"]))
    return out


def generations(run: dict[str, Any], priority: str) -> list[dict[str, Any]]:
    """The daemon's `generation_done` lines of one class that ended inside the run."""
    return [e for e in run.get("gate_log", []) if e["event"] == "generation_done" and e.get("priority") == priority]


def logged_token_times(run: dict[str, Any]) -> list[float]:
    """Background tokens as the daemon counted them (a synthetic model's tokens are mostly text-less,
    so the stream shows few): each generation's tokens spread evenly over its decode time."""
    out: list[float] = []
    for e in generations(run, "background"):
        n, tps = int(e.get("completion_tokens") or 0), float(e.get("decode_tps") or 0)
        if n and tps:
            start = e["t"] - n / tps
            out += [start + (i + 1) / tps for i in range(n)]
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pool the rounds of each scenario into one figure set."""
    out: dict[str, dict[str, Any]] = {}
    for name in SCENARIOS:
        mine = [r for r in runs if r["spec"]["name"] == name]
        if not mine:
            continue
        turns = [t for r in mine for t in r["turns"]]
        stt = [t["stt"]["latency_ms"] for t in turns if t["stt"]]
        ttfa = [t["tts"]["ttfa_ms"] for t in turns if t["tts"] and t["tts"]["ttfa_ms"] is not None]
        wall = sum(r["t1"] - r["t0"] for r in mine)
        tokens = sum(len(r["load"]["token_times"]) for r in mine)
        logged = sum(int(e.get("completion_tokens") or 0) for r in mine for e in generations(r, "background"))
        voice_ttft = [
            float(e["first_token_ms"])
            for r in mine
            for e in generations(r, "voice")
            if e.get("first_token_ms") is not None and e.get("completion_tokens")
        ]
        probe = [p for r in mine for p in r["probe"]]
        rtt = [p[2] for p in probe if p[1] != "error"]
        reactions = [
            float(e["reaction_ms"])
            for r in mine
            for e in r.get("gate_log", [])
            if e["event"] == "decode_parked" and e.get("reaction_ms") is not None
        ]
        by_phase: dict[str, list[float]] = {}
        idle_pauses = 0
        for r in mine:
            log = r.get("gate_log", [])
            idle_pauses += sum(1 for e in log if e["event"] == "decode_paused" and not e.get("generations"))
            for ph, xs in reactions_by_phase(log).items():
                by_phase.setdefault(ph, []).extend(xs)
        llm = [t["llm"] for t in turns if t["llm"]["status"] != "skipped"]
        ttft = [(x["first_token"] - x["start"]) * 1000 for x in llm if x["first_token"]]
        cpu_keys = sorted({k for r in mine for k in r["cpu_cores"]})
        out[name] = {
            "rounds": len(mine),
            "turns": len(turns),
            "stt_n": len(stt),
            "stt_p50": pct(stt, 0.5),
            "stt_p95": pct(stt, 0.95),
            "stt_p99": pct(stt, 0.99),
            "stt_mean": statistics.fmean(stt) if stt else None,
            "stt_p50_per_round": [pct([t["stt"]["latency_ms"] for t in r["turns"] if t["stt"]], 0.5) for r in mine],
            "tts_ttfa_p50": pct(ttfa, 0.5),
            "tts_ttfa_p95": pct(ttfa, 0.95),
            "llm_turns": len(llm),
            "llm_ok": sum(1 for x in llm if x["status"] == "ok"),
            "llm_deadline": sum(1 for x in llm if x["status"] == "deadline"),
            "llm_ttft_p50": pct(ttft, 0.5),
            "decode_tokens": tokens,
            "decode_tps": tokens / wall if wall > 0 else None,
            "decode_tokens_logged": logged,
            "decode_tps_logged": logged / wall if wall > 0 else None,
            "voice_ttft_daemon_p50": pct(voice_ttft, 0.5),
            "voice_ttft_daemon_p95": pct(voice_ttft, 0.95),
            "paused_fraction": (sum(1 for p in probe if p[1] == "paused") / len(probe)) if probe else None,
            "pauses": len(reactions),
            "reaction_p50": pct(reactions, 0.5),
            "reaction_p99": pct(reactions, 0.99),
            "reaction_by_phase": {
                ph: {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99), "max": max(xs, default=None)}
                for ph, xs in sorted(by_phase.items())
            },
            "idle_pauses": idle_pauses,
            "lag_p50": pct(rtt, 0.5),
            "lag_p99": pct(rtt, 0.99),
            "cpu_cores": {
                k: statistics.fmean([r["cpu_cores"][k] for r in mine if k in r["cpu_cores"]]) for k in cpu_keys
            },
            "wer": wer([(t["reference"], t["stt"]["text"]) for t in turns if t["stt"]]),
            "hold_timeouts": sum(r.get("proxy", {}).get("hold_timeouts", 0) for r in mine),
            "errors": [e for r in mine for e in r["errors"]][:10],
            "load_errors": [e for r in mine for e in r["load"]["errors"]][:5],
        }
    idle = out.get("idle")
    if idle:
        for s in out.values():
            s["ratios"] = {
                k: _ratio(s.get(k), idle.get(k))
                for k in (
                    "stt_p50",
                    "stt_p95",
                    "stt_p99",
                    "tts_ttfa_p50",
                    "llm_ttft_p50",
                    "voice_ttft_daemon_p50",
                    "lag_p50",
                )
            }
    return out


def _f(v: Any, digits: int = 0, unit: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}{unit}"
    return f"{v}{unit}"


def _phase_cell(s: dict[str, Any], phase: str) -> str:
    r = s.get("reaction_by_phase", {}).get(phase)
    return f"{r['n']} / {_f(r['p50'], 1)} / {_f(r['p99'], 1)}" if r and r["n"] else "–"


def stt_server_by_scenario(
    runs_t: dict[str, list[tuple[float, float]]], events: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The GPU STT server's own timings (encoder, decoder, whole request) per scenario, p50."""
    out: dict[str, dict[str, Any]] = {}
    for name, spans in runs_t.items():
        mine = [
            e for e in events if e.get("event") == "stt_done" and any(t0 <= float(e["t"]) <= t1 + 1 for t0, t1 in spans)
        ]
        out[name] = {
            k: pct([float(e[k]) for e in mine], 0.5) for k in ("mel_ms", "encoder_ms", "decoder_ms", "wall_ms")
        }
        out[name]["n"] = len(mine)
        out[name]["steps_p50"] = pct([float(e["steps"]) for e in mine], 0.5)
    return out


def summary_json(
    summary: dict[str, dict[str, Any]],
    meta: dict[str, Any],
    stt_events: list[dict[str, Any]] | None = None,
    runs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The headline figures, machine-readable (the keys docs/benchmarks.md names)."""
    names = [n for n in SCENARIOS if n in summary]
    arb = summary.get("arbitration", {})
    phases: dict[str, Any] = {}
    for ph in PHASES:
        r = arb.get("reaction_by_phase", {}).get(ph)
        phases[ph] = r["p99"] if r else None
    probe = meta.get("engine_probe") or {}
    out: dict[str, Any] = {
        "date": meta["date"],
        "label": meta.get("label", ""),
        "gpu": meta.get("gpu", False),
        "model": meta["model"],
        "backend": meta["backend"],
        "stack": meta["stack"],
        "stt_p50_ms": {n: summary[n]["stt_p50"] for n in names},
        "stt_p95_ms": {n: summary[n]["stt_p95"] for n in names},
        "stt_p99_ms": {n: summary[n]["stt_p99"] for n in names},
        "stt_p95_ratio_contention": summary.get("contention", {}).get("ratios", {}).get("stt_p95"),
        "stt_p95_ratio_arbitration": arb.get("ratios", {}).get("stt_p95"),
        "pause_reaction_p50_ms": {ph: (arb.get("reaction_by_phase", {}).get(ph) or {}).get("p50") for ph in PHASES},
        "pause_reaction_p99_ms": phases,
        "pause_reaction_n": {ph: (arb.get("reaction_by_phase", {}).get(ph) or {}).get("n", 0) for ph in PHASES},
        "idle_pauses": arb.get("idle_pauses"),
        "decode_step_ms": probe.get("decode_step_ms"),
        "prefill_tokens_per_s": probe.get("prompt_per_second"),
        "background_prompt_tokens": probe.get("prompt_n"),
        "background_decode_tps": {
            n: summary[n]["decode_tps_logged"] if meta.get("gpu") else summary[n]["decode_tps"] for n in names
        },
        "background_tps_kept_arbitration": _ratio(
            arb.get("decode_tps_logged"), summary.get("contention", {}).get("decode_tps_logged")
        ),
        "voice_ttft_daemon_p50_ms": {n: summary[n].get("voice_ttft_daemon_p50") for n in names},
        "voice_llm_ttft_p50_ms": {n: summary[n]["llm_ttft_p50"] for n in names},
        "voice_ttft_daemon_ratio_arbitration": arb.get("ratios", {}).get("voice_ttft_daemon_p50"),
        "hold_timeouts": {n: summary[n]["hold_timeouts"] for n in names},
        "stt_server": meta.get("stt_server"),
    }
    if stt_events and runs:
        spans: dict[str, list[tuple[float, float]]] = {}
        for r in runs:
            spans.setdefault(r["spec"]["name"], []).append((r["t0"], r["t1"]))
        out["stt_server_p50_ms"] = stt_server_by_scenario(spans, stt_events)
    return out


def machine() -> str:
    """One paragraph about the machine (for the report)."""
    la = os.getloadavg()
    freq = psutil.cpu_freq()
    return (
        f"{platform.machine()}, {psutil.cpu_count(logical=True)} logical CPUs"
        f" ({platform.processor() or 'cpu'}{f', {freq.current:.0f} MHz' if freq else ''}),"
        f" {psutil.virtual_memory().total / 2**30:.1f} GiB RAM, {platform.system()} {platform.release()},"
        f" Python {platform.python_version()}; load average at the end {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}"
    )


def markdown(summary: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The summary table and the context needed to read it."""
    names = [n for n in SCENARIOS if n in summary]
    rows: list[tuple[str, Any]] = [
        ("STT audio-stop → transcript p50 (ms)", lambda s: _f(s["stt_p50"])),
        ("STT p95 (ms)", lambda s: _f(s["stt_p95"])),
        ("STT p99 (ms)", lambda s: _f(s["stt_p99"])),
        ("STT p50 per round (ms)", lambda s: " / ".join(_f(v) for v in s["stt_p50_per_round"])),
        ("STT requests", lambda s: _f(s["stt_n"])),
        ("word error rate", lambda s: _f(None if s["wer"] is None else s["wer"] * 100, 1, " %")),
        ("TTS time to first audio p50 (ms)", lambda s: _f(s["tts_ttfa_p50"])),
        ("TTS time to first audio p95 (ms)", lambda s: _f(s["tts_ttfa_p95"])),
        (
            "voice LLM: first sentence in time / turns",
            lambda s: f"{s['llm_ok']}/{s['llm_turns']}" if s["llm_turns"] else "–",
        ),
        ("voice LLM time to first token p50 (ms)", lambda s: _f(s["llm_ttft_p50"])),
        ("background decode tokens/s", lambda s: _f(s["decode_tps"], 2)),
        ("background decode tokens (total)", lambda s: _f(s["decode_tokens"])),
        (
            "background tokens/s, daemon's count (generations ended in the run)",
            lambda s: _f(s.get("decode_tps_logged"), 1),
        ),
        (
            "voice LLM first token p50 / p95, daemon's count (ms)",
            lambda s: f"{_f(s.get('voice_ttft_daemon_p50'), 0)} / {_f(s.get('voice_ttft_daemon_p95'), 0)}",
        ),
        (
            "decode paused (share of the run)",
            lambda s: _f(None if s["paused_fraction"] is None else s["paused_fraction"] * 100, 1, " %"),
        ),
        ("pauses / reaction p50 (ms)", lambda s: f"{s['pauses']} / {_f(s['reaction_p50'], 1)}"),
        ("pause reaction p99 (ms)", lambda s: _f(s["reaction_p99"], 1)),
        *[
            (f"pause reaction in {ph}: n / p50 / p99 (ms)", lambda s, ph=ph: _phase_cell(s, ph))
            for ph in ("decode", "prefill")
        ],
        ("pauses that met an idle engine", lambda s: _f(s.get("idle_pauses"))),
        ("audio-stop holds that timed out (engine not parked)", lambda s: _f(s["hold_timeouts"])),
        ("loop lag probe: GET /health p50 (ms)", lambda s: _f(s["lag_p50"], 1)),
        ("loop lag probe: GET /health p99 (ms)", lambda s: _f(s["lag_p99"], 1)),
    ]
    procs = sorted({k for n in names for k in summary[n]["cpu_cores"]})
    for p in [*[q for q in procs if q != "other"], *[q for q in procs if q == "other"]]:
        label = "CPU: everything else on the machine (cores)" if p == "other" else f"CPU {p} (cores)"
        rows.append((label, lambda s, p=p: _f(s["cpu_cores"].get(p), 2)))
    head = "| figure | " + " | ".join(names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(fn(summary[n]) for n in names) + " |" for label, fn in rows]
    ratio_lines = [
        "| ratio to idle | " + " | ".join(n for n in names if n != "idle") + " |",
        "|---|" + "---|" * (len(names) - 1),
    ]
    for key, label in (
        ("stt_p50", "STT p50"),
        ("stt_p95", "STT p95"),
        ("stt_p99", "STT p99"),
        ("tts_ttfa_p50", "TTS first audio p50"),
        ("llm_ttft_p50", "voice LLM time to first token p50"),
        ("voice_ttft_daemon_p50", "voice LLM first token p50, daemon's count"),
        ("lag_p50", "loop lag p50"),
    ):
        ratio_lines.append(
            f"| {label} | "
            + " | ".join(_f(summary[n].get("ratios", {}).get(key), 2, "x") for n in names if n != "idle")
            + " |"
        )
    errors = [f"- {n}: {e}" for n in names for e in summary[n]["errors"] + summary[n]["load_errors"]]
    parts = [
        f"# Voice path under LLM load — {meta['date']}",
        "",
        f"Machine: {meta['machine']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Stack: {meta['stack']}. LLM: {meta['model']} ({meta['backend']} engine, threads {meta['threads']}).",
        f"Policies: contention `{meta['policies']['contention']}`, arbitration `{meta['policies']['arbitration']}`; "
        f"whisper proxy hold_audio_stop_until_parked={meta['proxy']['hold_audio_stop_until_parked']}, "
        f"hold_max_ms={meta['proxy']['hold_max_ms']}.",
        f"Each run: {meta['turns']} voice turns, one every {meta['period_s']} s (audio streamed at "
        f"{meta['realtime']}x real time); load runs: {meta['load_clients']} background clients x "
        f"{meta['load_tokens']}-token stories. Rounds: {meta['rounds']} (order {' → '.join(meta['order'])}), "
        f"pooled per scenario. Wall time {meta['wall_s']:.0f} s."
        + (f" All bench processes ran at nice {meta['nice']}." if meta.get("nice") else ""),
        *_gpu_lines(meta),
        "",
        *lines,
        "",
        *ratio_lines,
        "",
        "Figures are explained in docs/benchmarks.md. Timeline: timeline.png; raw samples: results.json.",
    ]
    if errors:
        parts += ["", "Errors:", *errors]
    return "\n".join(parts) + "\n"


def _gpu_lines(meta: dict[str, Any]) -> list[str]:
    """The engine's own speed (measured alone, same run) and the GPU STT server, when known."""
    out = []
    p = meta.get("engine_probe") or {}
    if p.get("predicted_n"):
        out.append(
            f"Engine alone (one background-shaped request, nothing else running): prompt {p.get('prompt_n')} tokens "
            f"at {_f(p.get('prompt_per_second'), 0)} tok/s, decode step {_f(p.get('decode_step_ms'), 2)} ms."
        )
    srv = meta.get("stt_server")
    if srv:
        out.append(
            f"STT server: whisper-{srv.get('size')} shape, random weights, {srv.get('device')} {srv.get('dtype')}, "
            f"{srv.get('sms', '?')} SMs visible to it."
        )
    if meta.get("label"):
        out.append(f"Label: {meta['label']}.")
    if meta.get("load_prompt_chars"):
        out.append(
            f"Background prompts: {meta['load_prompt_chars']} characters of context + the story request "
            "(each request numbered, so no cached prefix)."
        )
    return [""] + out if out else []


def _bins(times: Iterable[float], t0: float, t1: float, width: float = 1.0) -> tuple[list[float], list[float]]:
    n = max(1, int(math.ceil((t1 - t0) / width)))
    counts = [0] * n
    for t in times:
        i = int((t - t0) / width)
        if 0 <= i < n:
            counts[i] += 1
    return [(i + 0.5) * width for i in range(n)], [c / width for c in counts]


def plot(runs: list[dict[str, Any]], path: Path, window_s: float = 40.0) -> None:
    """Timeline PNG: per scenario (its first round) STT/TTS bars, gate state and decode tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    firsts = [
        next(r for r in runs if r["spec"]["name"] == n) for n in SCENARIOS if any(r["spec"]["name"] == n for r in runs)
    ]
    fig, axes = plt.subplots(
        len(firsts) * 2,
        1,
        figsize=(12, 3.2 * len(firsts)),
        squeeze=False,
        gridspec_kw={"height_ratios": [1, 1.4] * len(firsts)},
    )
    for k, run in enumerate(firsts):
        ax_act, ax_tps = axes[2 * k][0], axes[2 * k + 1][0]
        t0 = run["t0"]
        t1 = min(run["t1"], t0 + window_s)
        # Activity rows: gate (y=0), TTS (y=1), STT (y=2).
        gate_color = {"paused": "tab:red", "throttled": "tab:orange"}
        probe = run["probe"]
        for (ta, mode, _), (tb, _, _) in zip(probe, probe[1:], strict=False):
            if mode in gate_color and ta < t1:
                ax_act.broken_barh([(ta - t0, tb - ta)], (0.1, 0.8), color=gate_color[mode], linewidth=0)
        for t in run["turns"]:
            s = t["stt"]
            if s:
                ax_act.broken_barh([(s["start"] - t0, s["stop"] - s["start"])], (2.1, 0.8), color="tab:cyan")
                ax_act.broken_barh([(s["stop"] - t0, s["end"] - s["stop"])], (2.1, 0.8), color="tab:blue")
            if t["llm"]["start"]:
                end = t["llm"]["sentence"] or (t["tts"]["start"] if t["tts"] else t["llm"]["start"])
                ax_act.broken_barh([(t["llm"]["start"] - t0, end - t["llm"]["start"])], (1.1, 0.8), color="tab:gray")
            v = t["tts"]
            if v:
                ax_act.broken_barh([(v["start"] - t0, v["end"] - v["start"])], (1.1, 0.8), color="tab:green")
        ax_act.set_yticks([0.5, 1.5, 2.5], ["gate", "LLM/TTS", "STT"])
        ax_act.set_xlim(0, t1 - t0)
        ax_act.set_ylim(0, 3)
        ax_act.set_title(
            f"{run['spec']['name']}: STT (cyan: audio streaming, blue: audio-stop → transcript), "
            f"voice LLM (gray), TTS (green), gate paused (red) / throttled (orange)",
            fontsize=9,
        )
        streamed, logged = run["load"]["token_times"], logged_token_times(run)
        xs, ys = _bins(logged if len(logged) > len(streamed) else streamed, t0, t1)
        ax_tps.plot(xs, ys, drawstyle="steps-mid", color="tab:purple")
        ax_tps.set_xlim(0, t1 - t0)
        ax_tps.set_ylim(bottom=0)
        ax_tps.set_ylabel("decode tok/s")
        ax_tps.set_xlabel("seconds since the run started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record_result(out: Path, summary: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    """The run's ratios to idle (and on the GPU the pause reaction) into bench/results/index.json."""
    ratios = {n: summary.get(n, {}).get("ratios", {}) for n in ("contention", "arbitration")}
    figures: dict[str, tuple[float, str]] = {
        f"{key}_ratio_{n}": (round(v, 2), "x")
        for n, r in ratios.items()
        for key in ("stt_p95", "tts_ttfa_p50", "llm_ttft_p50", "voice_ttft_daemon_p50")
        if (v := r.get(key)) is not None
    }

    def x(n: str, key: str) -> str:
        return _f(ratios[n].get(key), 2, "x")

    if meta.get("gpu"):
        phases = summary.get("arbitration", {}).get("reaction_by_phase", {})
        for ph in ("prefill", "decode"):
            if phases.get(ph):
                figures[f"pause_reaction_p99_{ph}_ms"] = (round(phases[ph]["p99"], 1), "ms")
        reaction = "; ".join(
            f"{ph} pause reaction p99 {phases[ph]['p99']:.1f} ms" for ph in ("prefill", "decode") if phases.get(ph)
        )
        headline = (
            f"{meta.get('label') or 'GPU'}: STT p95 contention {x('contention', 'stt_p95')}, "
            f"arbitration {x('arbitration', 'stt_p95')}" + (f"; {reaction}" if reaction else "")
        )
        name, command = "voice_path_gpu", "`python -m bench.voice_path --gpu` (`bash bench/gpu_stt/device_run.sh`)"
    else:
        headline = (
            f"under arbitration voice first token {x('arbitration', 'llm_ttft_p50')} idle, TTS first audio "
            f"{x('arbitration', 'tts_ttfa_p50')}, STT p95 {x('arbitration', 'stt_p95')} (contention "
            f"{x('contention', 'llm_ttft_p50')} / {x('contention', 'tts_ttfa_p50')} / {x('contention', 'stt_p95')})"
        )
        name, command = "voice_path", "`make bench-voice` (CPU voice path)"
    record(
        "voice_path",
        out,
        figures,
        reference="the idle run, same daemon and servers",
        headline=headline,
        command=command,
        entry=name,
    )
