"""Soak: thousands of mixed operations against the real daemon; RSS, FDs and threads must stay flat.

    .venv/bin/python -m bench.soak                   # 2,000 operations, concurrency 4 (make bench-soak)
    .venv/bin/python -m bench.soak --requests 200    # a short run

The daemon runs as a subprocess (`genie-supervisor run`) with SmolLM2-135M and Gemma-3-270M in one
swap group, a real Mosquitto on a free loopback port, and a policy folder of its own. A seeded
schedule mixes streaming and non-streaming chat and text completions, streams closed after three
chunks, voice hints over HTTP and MQTT, policy reloads (file watcher, SIGHUP, MQTT; now and then an
invalid file that must be rejected), MQTT policy select, MQTT LLM OFF/ON bursts ending ON, model
swaps and an /unload. The daemon's RSS, open file descriptors and threads are sampled every second.
Results (results.json, summary.md, soak.png) go to bench/results/soak-<YYYYMMDD-HHMMSS>/.
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.record import record
from bench.soak_ops import Ctx, OpResult, run_op
from bench.soak_report import analyse, plot, summary_md
from bench.soak_stack import HOST, ROOT, Daemon, Mosquitto, log_problems, write_files

CACHE = Path(os.environ.get("GENIE_MODELS_DIR") or Path.home() / ".cache" / "genie-supervisor" / "models")
WEIGHTS = {
    "chat": 25,
    "completion": 15,
    "chat_stream": 15,
    "completion_stream": 8,
    "disconnect": 10,
    "voice_http": 10,
    "voice_mqtt": 5,
    "policy_reload": 5,
    "policy_select": 2,
}
"""Share of each operation in the random mix (each at least once)."""
LOAD_OPS = ("swap", "llm_toggle", "unload")
"""Operations that unload or load a model, placed at fixed points (`--load-window`), not drawn at random."""


def schedule(
    n: int, seed: int, *, swaps: int = 2, toggles: int = 4, window: tuple[float, float] = (0.1, 0.35)
) -> list[str]:
    """About `n` operations (more when `n` is too small to hold one of each) shuffled with `seed`, with the
    model-load events spread evenly over `window` (fractions of the run) and the unload at its end.

    By default the window ends before the second half, where the slopes are fitted: each load cycle
    moves RSS by tens of MB (freed weights the allocator keeps), which is not what requests leave behind."""
    rng = random.Random(seed)
    fixed = swaps + toggles + 1
    total = sum(WEIGHTS.values())
    ops: list[str] = []
    for op, w in WEIGHTS.items():
        if op != "chat":
            ops += [op] * max(round((n - fixed) * w / total), 1)
    ops += ["chat"] * max(n - fixed - len(ops), 1)
    rng.shuffle(ops)
    lo, hi = window
    at = [(lo + (hi - lo) * (k + 0.5) / swaps, "swap") for k in range(swaps)]
    at += [(lo + (hi - lo) * (k + 0.25) / toggles, "llm_toggle") for k in range(toggles)]
    at.append((hi, "unload"))
    for frac, op in sorted(at):
        ops.insert(min(int(frac * n), len(ops)), op)
    return ops


class Sampler(threading.Thread):
    """RSS, open FDs, threads and CPU of the daemon every `interval` s, tagged with the operations done."""

    def __init__(self, pid: int, interval: float, done: Callable[[], int]) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.proc = psutil.Process(pid)
        self.interval, self.done = interval, done
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> None:
        try:
            with self.proc.oneshot():
                self.samples.append(
                    {
                        "t": round(time.monotonic() - self.t0, 3),
                        "done": self.done(),
                        "rss": self.proc.memory_info().rss,
                        "fds": self.proc.num_fds(),
                        "threads": self.proc.num_threads(),
                        "cpu": self.proc.cpu_percent(),
                    }
                )
        except psutil.Error:
            pass

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()


async def drive(
    ctx: Ctx, ops: list[str], concurrency: int, daemon: Daemon, progress: Callable[[int], None]
) -> list[OpResult]:
    """Run the schedule with `concurrency` workers; stops early if the daemon dies."""
    results: list[OpResult] = []
    it = iter(enumerate(ops))

    async def worker() -> None:
        for i, op in it:
            daemon.check_alive()
            results.append(await run_op(ctx, i, op))
            progress(len(results))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def probe(ctx: Ctx, n: int) -> list[float]:
    """Decode speed (server timings) of `n` identical requests one after the other, nothing else running."""
    speeds: list[float] = []
    for _ in range(n):
        r = await ctx.http.post(
            "/v1/chat/completions",
            json={
                "model": "smollm2",
                "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": 32,
                "temperature": 0,
            },
        )
        r.raise_for_status()
        tps = (r.json().get("timings") or {}).get("predicted_per_second")
        if tps:
            speeds.append(round(float(tps), 2))
    return speeds


async def end_state(ctx: Ctx, timeout: float = 30) -> dict[str, Any]:  # noqa: ASYNC109
    """Wait (bounded) until nothing runs or waits; what /status and /metrics say then."""

    def idle(s: dict[str, Any]) -> bool:
        adm = s["admission"]
        return (
            adm["running"] == 0
            and adm["queued"] == 0
            and all(m["in_flight"] == 0 and not m["draining"] for m in s["models"])
        )

    t0 = time.monotonic()
    st = await ctx.wait_status(idle, timeout) or await ctx.status()
    from prometheus_client.parser import text_string_to_metric_families

    text = (await ctx.http.get("/metrics")).text
    metrics: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in ("genie_requests_in_flight", "genie_slots_in_use", "genie_queue_depth"):
            metrics[fam.name] = sum(s.value for s in fam.samples)
    adm = st["admission"]
    models = {
        m["id"]: {
            "state": m["state"],
            "in_flight": m["in_flight"],
            "draining": m["draining"],
            "evictions": m["evictions"],
        }
        for m in st["models"]
    }
    quiescent = idle(st) and all(v == 0 for v in metrics.values())
    return {
        "quiescent": quiescent,
        "waited_s": round(time.monotonic() - t0, 2),
        "admission": {k: adm[k] for k in ("running", "max_running", "queued", "max_queue", "admitted", "rejected")},
        "models": models,
        "metrics": metrics,
        "gate": st["gate"].get("mode"),
        "voice": st.get("voice"),
        "policy": st["policy"],
        "llm_enabled": st["engine"].get("enabled"),
        "summary": (
            f"slots {adm['running']}/{adm['max_running']}, queued {adm['queued']}, in flight "
            f"{sum(m['in_flight'] for m in st['models'])}, metrics {metrics}, gate {st['gate'].get('mode')}"
        ),
    }


def _mqtt_client(port: int) -> Any:
    import paho.mqtt.client as mqtt

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"soak-{os.getpid()}")
    client.connect(HOST, port, keepalive=30)
    client.loop_start()
    return client


async def _soak(
    args: argparse.Namespace,
    daemon: Daemon,
    mqtt_port: int,
    say: Callable[[str], None],
) -> tuple[list[OpResult], list[dict[str, Any]], dict[str, Any], dict[str, int], float]:
    headers = dict(daemon.headers)
    mqtt = _mqtt_client(mqtt_port)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(
        base_url=daemon.url, headers=headers, limits=limits, timeout=httpx.Timeout(args.request_timeout, connect=10)
    ) as http:
        ctx = Ctx(http=http, daemon=daemon, mqtt=mqtt, rng=random.Random(args.seed + 1))
        say(f"warm-up: {args.warmup} requests")
        for k in range(args.warmup):
            res = await run_op(ctx, -1, "chat" if k % 2 else "completion")
            if not res.ok:
                raise RuntimeError(f"warm-up request failed: {res.status} {res.detail}")
        before = await probe(ctx, args.probes)
        ops = schedule(args.requests, args.seed, swaps=args.swaps, toggles=args.toggles, window=args.load_window)
        done = [0]
        sampler = Sampler(daemon.pid, args.interval, lambda: done[0])
        sampler.sample()
        sampler.start()
        step = max(len(ops) // 10, 1)

        def progress(n: int) -> None:
            done[0] = n
            if n % step == 0:
                s = sampler.samples[-1] if sampler.samples else {}
                say(
                    f"{n}/{len(ops)} ops, {time.monotonic() - t0:.0f} s, RSS {s.get('rss', 0) / 1e6:.1f} MB, "
                    f"FDs {s.get('fds')}, threads {s.get('threads')}"
                )

        t0 = time.monotonic()
        try:
            results = await drive(ctx, ops, args.concurrency, daemon, progress)
        finally:
            duration = time.monotonic() - t0
            sampler.stop.set()
            sampler.join(5)
        end = await end_state(ctx)
        sampler.sample()
        end["probe"] = {"before": before, "after": await probe(ctx, args.probes)}
    mqtt.loop_stop()
    mqtt.disconnect()
    return results, sampler.samples, end, ctx.counters, duration


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    return (
        f"{platform.system()} {platform.machine()} ({cpu}), {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )


def _window(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    if not 0 <= lo <= hi <= 1:
        raise argparse.ArgumentTypeError(f"expected A,B with 0 <= A <= B <= 1, got {text!r}")
    return lo, hi


def _env(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="operations in the schedule (default 2000)")
    p.add_argument("--concurrency", type=int, default=4, help="operations at once (default 4)")
    p.add_argument("--swaps", type=int, default=2, help="model swaps to Gemma-3 (default 2)")
    p.add_argument(
        "--toggles", type=int, default=4, help="MQTT LLM OFF/ON bursts (20 commands each, ending ON; default 4)"
    )
    p.add_argument(
        "--load-window",
        type=_window,
        default=(0.1, 0.35),
        metavar="A,B",
        help="fractions of the run over which swaps, bursts and the unload are spread (default 0.1,0.35, so that RSS settles after the last model load before the fitted half; "
        "0.05,0.95 puts model loads into the fitted second half too)",
    )
    p.add_argument("--warmup", type=int, default=10, help="untimed requests before the schedule (default 10)")
    p.add_argument(
        "--probes", type=int, default=8, help="isolated speed probes before and after the schedule (default 8)"
    )
    p.add_argument("--interval", type=float, default=1.0, help="sampling interval in s (default 1)")
    p.add_argument("--seed", type=int, default=15, help="schedule seed (default 15)")
    p.add_argument("--threads", type=int, default=None, help="engine.threads of the daemon (default: all cores)")
    p.add_argument("--max-running", type=int, default=2, help="api.max_running of the daemon (default 2)")
    p.add_argument(
        "--env",
        type=_env,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra environment of the daemon, repeatable (e.g. MALLOC_ARENA_MAX=1)",
    )
    p.add_argument("--request-timeout", type=float, default=180, help="deadline of one HTTP request in s (default 180)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("GENIE_SOAK_API_KEY"),
        help="set api.api_key in the daemon's config and send it (default $GENIE_SOAK_API_KEY; none)",
    )
    p.add_argument("--smollm2", type=Path, default=CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--gemma3", type=Path, default=CACHE / "gemma-3-270m-q4_k_m.gguf")
    p.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/soak-<date>)")
    p.add_argument("--workdir", type=Path, default=None, help="config, policies and logs (default a temp dir)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the soak; write results.json, summary.md, soak.png and the daemon log; the analysis."""
    args = parse_args(argv)
    for m in (args.smollm2, args.gemma3):
        if not m.exists():
            raise SystemExit(f"{m} missing: run `genie-supervisor models fetch smollm2` and `... gemma3`")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "bench" / "results" / f"soak-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="genie-soak-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        broker = Mosquitto(work)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        files = write_files(
            work,
            broker.port,
            smollm2=args.smollm2,
            gemma3=args.gemma3,
            threads=args.threads,
            api_key=args.api_key,
            max_running=args.max_running,
        )
        daemon = Daemon(files, out / "daemon.log", headers, dict(args.env))
        rc: int | None = None
        try:
            daemon.start()
            say(
                f"daemon pid {daemon.pid} on {daemon.url}, broker :{broker.port}, {args.requests} ops x{args.concurrency}"
            )
            results, samples, end, counters, duration = asyncio.run(_soak(args, daemon, broker.port, say))
        finally:
            rc = daemon.stop()
            broker.stop()
    rows = [asdict(r) for r in results]
    analysis = analyse(samples, rows, len(rows), end, rc)
    t_first = min((r.t0 for r in results), default=0.0)
    marks = [(sum(1 for q in results if q.t1 <= r.t0), r.op) for r in results if r.op in LOAD_OPS]
    meta = {
        "started": stamp,
        "command": "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": _machine(),
        "daemon": f"genie-supervisor (builtin engine, backend auto, threads {args.threads or 'all'}"
        + "".join(f", {k}={v}" for k, v in args.env)
        + ")",
        "requests": len(results),
        "concurrency": args.concurrency,
        "seed": args.seed,
        "duration_s": duration,
        "ops_per_s": len(results) / duration if duration else 0.0,
        "counters": counters,
        "log_problems": log_problems(out / "daemon.log"),
        "args": {k: str(v) for k, v in vars(args).items() if k != "api_key"},
    }
    for r in rows:  # times relative to the first operation
        r["t0"], r["t1"] = round(r["t0"] - t_first, 3), round(r["t1"] - t_first, 3)
    (out / "results.json").write_text(
        json.dumps({"meta": meta, "analysis": analysis, "samples": samples, "results": rows}, indent=1) + "\n",
        encoding="utf-8",
    )
    (out / "summary.md").write_text(summary_md(meta, analysis), encoding="utf-8")
    plot(
        samples,
        marks,
        out / "soak.png",
        f"genie-supervisor soak: {len(results)} ops x{args.concurrency} ({stamp})",
        len(results),
    )
    for name, g in analysis["goals"].items():
        say(f"{'PASS' if g['pass'] else 'FAIL'}  {name}: {g['value']}")
    _record(out, meta, analysis)
    say(f"results in {out}")
    return {"out": out, "meta": meta, "analysis": analysis}


def _record(out: Path, meta: dict[str, Any], analysis: dict[str, Any]) -> None:
    """The headline figures into the results index (only for a run written to bench/results/)."""
    g = analysis["goals"]
    rss, speed = analysis["rss_mb"]["slope_per_1000"], analysis["decode_speed_server"]["ratio"]
    failed = [name for name, v in g.items() if not v["pass"]]
    record(
        "soak",
        out,
        {
            "requests": (meta["requests"], "operations"),
            "unexpected_failures": (analysis["errors"]["unexpected"], "operations"),
            **({"rss_slope_mb_per_1000": (rss, "MB")} if rss is not None else {}),
            **({"decode_last_first_decile": (speed, "x")} if speed is not None else {}),
        },
        reference="the goals (RSS slope < 1 MB / 1,000, decode speed within 10 %)",
        headline=f"{meta['requests']:,} operations, "
        + ("every goal PASS" if not failed else "FAIL: " + ", ".join(failed))
        + f" (RSS slope {rss} MB / 1,000 requests)",
        command="`make bench-soak`",
    )


if __name__ == "__main__":
    main()
