"""The soak's figures from its samples and results: slopes, decode-speed deciles, errors, goals; summary and plot."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

MB = 1_000_000
"""RSS is reported in MB (10^6 bytes), the unit of the goal."""
RSS_SLOPE_GOAL_MB = 1.0
"""RSS may grow by less than this per 1,000 requests (second half)."""
SPEED_GOAL = 0.10
"""The last decile's median decode speed within this fraction of the first decile's."""


def slope_per_1000(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys against xs, per 1,000 units of x (None with fewer than 3 distinct xs)."""
    if len(set(xs)) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def second_half(samples: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The samples taken once half of the `n` requests were done (the warm-up is long over)."""
    return [s for s in samples if s["done"] >= n / 2]


def trend(samples: list[dict[str, Any]], n: int, key: str, scale: float = 1.0) -> dict[str, Any]:
    """First, last, min, max and the second-half slope per 1,000 requests of one sampled value."""
    vals = [s[key] / scale for s in samples]
    half = second_half(samples, n)
    return {
        "first": round(vals[0], 3) if vals else None,
        "last": round(vals[-1], 3) if vals else None,
        "min": round(min(vals), 3) if vals else None,
        "max": round(max(vals), 3) if vals else None,
        "slope_per_1000": _r(slope_per_1000([float(s["done"]) for s in half], [s[key] / scale for s in half])),
        "second_half_samples": len(half),
        "second_half_first": round(half[0][key] / scale, 3) if half else None,
        "second_half_last": round(half[-1][key] / scale, 3) if half else None,
    }


def deciles(results: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Median of `key` over the first and the last tenth of the non-streaming SmolLM2 requests that have it."""
    vals = [r[key] for r in sorted(results, key=lambda r: r["i"]) if r["i"] >= 0 and r.get(key)]
    k = max(len(vals) // 10, 1)
    if len(vals) < 2:
        return {"n": len(vals), "first": None, "last": None, "ratio": None}
    first, last = statistics.median(vals[:k]), statistics.median(vals[-k:])
    return {
        "n": len(vals),
        "per_decile": k,
        "first": round(first, 2),
        "last": round(last, 2),
        "ratio": round(last / first, 4) if first else None,
    }


def isolated(probe: dict[str, list[float]]) -> dict[str, Any]:
    """Median decode speed of the sequential probes before and after the schedule, and their ratio."""
    before, after = probe.get("before") or [], probe.get("after") or []
    if not before or not after:
        return {"n": min(len(before), len(after)), "first": None, "last": None, "ratio": None}
    first, last = statistics.median(before), statistics.median(after)
    return {
        "n": min(len(before), len(after)),
        "first": round(first, 2),
        "last": round(last, 2),
        "ratio": round(last / first, 4) if first else None,
    }


def errors(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Failed operations by status (unexpected ones, and those the soak provoked) and by operation."""
    failed = [r for r in results if not r["ok"]]
    unexpected = [r for r in failed if not r["excused"]]
    return {
        "total_failed": len(failed),
        "unexpected": len(unexpected),
        "unexpected_by_status": dict(Counter(r["status"] for r in unexpected)),
        "unexpected_by_op": dict(Counter(r["op"] for r in unexpected)),
        "excused_by_status": dict(Counter(r["status"] for r in failed if r["excused"])),
        "status_counts": dict(Counter(r["status"] for r in results)),
        "examples": [{k: r[k] for k in ("i", "op", "status", "detail")} for r in unexpected[:10]],
    }


def goals(analysis: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """PASS/FAIL of the issue's three goals (plus no unexpected errors and a graceful exit)."""
    rss = analysis["rss_mb"]["slope_per_1000"]
    speed = analysis["decode_speed_server"]["ratio"]
    end = analysis["end"]
    return {
        "rss_slope": {
            "pass": rss is not None and rss < RSS_SLOPE_GOAL_MB,
            "value": f"{rss} MB / 1,000 requests (goal < {RSS_SLOPE_GOAL_MB})",
        },
        "speed": {
            "pass": speed is not None and abs(speed - 1) <= SPEED_GOAL,
            "value": f"last/first decile {speed} (goal within {SPEED_GOAL:.0%})",
        },
        "nothing_in_flight": {"pass": bool(end["quiescent"]), "value": end["summary"]},
        "no_unexpected_errors": {
            "pass": analysis["errors"]["unexpected"] == 0,
            "value": f"{analysis['errors']['unexpected']} unexpected failures",
        },
        "graceful_exit": {"pass": analysis["daemon_exit"] == 0, "value": f"rc {analysis['daemon_exit']}"},
    }


def _r(v: float | None, nd: int = 4) -> float | None:
    return None if v is None else round(v, nd)


def analyse(
    samples: list[dict[str, Any]], results: list[dict[str, Any]], n: int, end: dict[str, Any], daemon_exit: int | None
) -> dict[str, Any]:
    probes = [r for r in results if r["ok"] and r["op"] in ("chat", "completion")]
    analysis: dict[str, Any] = {
        "rss_mb": trend(samples, n, "rss", MB),
        "fds": trend(samples, n, "fds"),
        "threads": trend(samples, n, "threads"),
        "decode_speed_server": deciles(probes, "server_tps"),
        "decode_speed_client": deciles(probes, "client_tps"),
        "decode_speed_isolated": isolated(end.get("probe") or {}),
        "ops": dict(Counter(r["op"] for r in results)),
        "errors": errors(results),
        "end": end,
        "daemon_exit": daemon_exit,
    }
    analysis["goals"] = goals(analysis)
    return analysis


def summary_md(meta: dict[str, Any], a: dict[str, Any]) -> str:
    """The human summary: what ran, the figures, the goals."""
    g = a["goals"]
    lines = [
        f"# Soak {meta['started']}",
        "",
        f"`{meta['command']}`",
        "",
        f"Machine: {meta['machine']}. Daemon: {meta['daemon']}.",
        f"{meta['requests']} operations, concurrency {meta['concurrency']}, seed {meta['seed']}, "
        f"{meta['duration_s']:.0f} s ({meta['ops_per_s']:.2f} ops/s; 2,000 would take ~{2000 / meta['ops_per_s'] / 60:.0f} min).",
        "",
        "| goal | result | value |",
        "|---|---|---|",
        *[f"| {name} | {'PASS' if v['pass'] else 'FAIL'} | {v['value']} |" for name, v in g.items()],
        "",
        "| sampled | first | last | min | max | 2nd half: first | last | slope / 1,000 req |",
        "|---|---|---|---|---|---|---|---|",
        *[
            f"| {label} | {t['first']} | {t['last']} | {t['min']} | {t['max']} | {t['second_half_first']} | "
            f"{t['second_half_last']} | {t['slope_per_1000']} |"
            for label, t in (("RSS (MB)", a["rss_mb"]), ("open FDs", a["fds"]), ("threads", a["threads"]))
        ],
        "",
        "| decode speed (tok/s, median) | first decile | last decile | last/first | requests |",
        "|---|---|---|---|---|",
        *[
            f"| {label} | {d['first']} | {d['last']} | {d['ratio']} | {d['n']} |"
            for label, d in (
                ("server timings", a["decode_speed_server"]),
                ("client view", a["decode_speed_client"]),
                ("isolated probes (before / after)", a["decode_speed_isolated"]),
            )
        ],
        "",
        _drift(a),
        "",
        f"Operations: {', '.join(f'{k} {v}' for k, v in sorted(a['ops'].items()))}.",
        "",
        f"Events: {', '.join(f'{k} {v}' for k, v in sorted(meta['counters'].items()))}.",
        "",
        f"Status counts: {a['errors']['status_counts']}; unexpected failures by status "
        f"{a['errors']['unexpected_by_status'] or 'none'}; provoked (503 during the soak's own LLM-off bursts) "
        f"{a['errors']['excused_by_status'] or 'none'}.",
        "",
        f"At the end: {a['end']['summary']}.",
        "",
        f"Daemon log: {meta['log_problems']}.",
        "",
    ]
    return "\n".join(lines)


def _drift(a: dict[str, Any]) -> str:
    """One sentence on whether a speed change is the daemon's or the machine's (the isolated probes)."""
    dec, iso = a["decode_speed_server"]["ratio"], a["decode_speed_isolated"]["ratio"]
    if dec is None or iso is None:
        return "Speed drift check: not enough samples."
    return (
        f"Speed drift check: the isolated probes (one request at a time, before and after) moved by "
        f"{iso - 1:+.0%}, the deciles by {dec - 1:+.0%}; when both move together the machine's load changed, "
        f"not the daemon (decile ratio / probe ratio {dec / iso:.3f})."
    )


def plot(samples: list[dict[str, Any]], marks: list[tuple[int, str]], path: Path, title: str, n: int) -> None:
    """RSS, open FDs and threads against requests done; model-load operations as vertical lines, the
    second half (where the slopes are fitted) shaded with its least-squares line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["done"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for ax, key, label, scale in (
        (axes[0], "rss", "RSS (MB)", MB),
        (axes[1], "fds", "open FDs", 1),
        (axes[2], "threads", "threads", 1),
    ):
        ax.plot(xs, [s[key] / scale for s in samples], lw=1)
        half = second_half(samples, n)
        hx, hy = [float(s["done"]) for s in half], [s[key] / scale for s in half]
        k = slope_per_1000(hx, hy)
        if k is not None:
            mx, my = statistics.fmean(hx), statistics.fmean(hy)
            ax.axvspan(n / 2, max(hx), color="tab:green", alpha=0.06)
            ax.plot(
                [hx[0], hx[-1]],
                [my + k / 1000 * (hx[0] - mx), my + k / 1000 * (hx[-1] - mx)],
                color="tab:green",
                lw=1,
                ls="--",
                label=f"2nd-half slope {k:+.2f} / 1,000",
            )
            ax.legend(loc="lower right", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        colours = {"swap": "tab:red", "unload": "tab:purple", "llm_toggle": "tab:orange"}
        for x, op in marks:
            ax.axvline(x, color=colours.get(op, "grey"), lw=0.6, alpha=0.6)
    axes[-1].set_xlabel("operations done (red: swap, purple: unload, orange: LLM OFF/ON burst)")
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
