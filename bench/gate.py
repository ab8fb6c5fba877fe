"""Decode gate on CPU with SmolLM2: pause reaction time, event-loop lag, and the gate's overhead.

    python -m bench.gate [--model PATH] [--tokens 96] [--cycles 30] [--out FILE]

Measured in one run, against references from the same run:
- decode tokens/s with no gate vs with an open DecodeGate (ratio: the gate's cost);
- pause reaction (pause requested -> generation parked) p50/p99 over many pause/resume cycles
  during one long generation, also in units of the mean decode step;
- event-loop lag (a 5 ms sleeper's lateness) p50/p99 while idle vs while the engine decodes.
Writes --out (bench/results/gate.md) and records the figures in bench/results/index.json.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import anyio

from bench.record import RESULTS, record
from engine import Generation, Model, SamplingParams, load_model
from genie_supervisor.arbiter import DecodeGate
from genie_supervisor.logging import configure_logging

DEFAULT_MODEL = Path.home() / ".cache" / "genie-supervisor" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [{"role": "user", "content": "Tell me everything you know about the history of bread."}]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else float("nan")


async def lag_probe(stop: anyio.Event, out: list[float], period: float = 0.005) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        await anyio.sleep(period)
        out.append((time.monotonic() - t0 - period) * 1000.0)


async def decode_tps(model: Model, ids: list[int], n: int, gate: DecodeGate | None) -> float:
    model.transformer.kv.tokens = []  # no prefix cache between the compared runs
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    gen = model.generate(ids, params, gate=gate)
    async for _ in gen:  # the engine enters gate.running() itself while it holds the model
        pass
    return gen.stats.decode_tps


async def pause_reactions(gen: Generation, gate: DecodeGate, cycles: int, step_s: float, hold_s: float) -> list[float]:
    """Pause `gate` `cycles` times, each at a random (seeded) point inside a decode step of `gen`, which
    this runs, and open it `hold_s` after it parked; each pause's reaction (pause -> parked) in ms."""
    rng = random.Random(0)
    reactions: list[float] = []
    first = anyio.Event()

    async def consume() -> None:
        async for _ in gen:
            first.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await first.wait()  # measure decode steps only (a pause during prefill waits one chunk)
        for _ in range(cycles):
            await anyio.sleep(rng.uniform(0.5, 2.0) * step_s)  # land anywhere inside a step
            t0 = time.monotonic()
            gate.pause({"bench"}, cause_ts=t0)
            if await gate.wait_parked(30):
                reactions.append((time.monotonic() - t0) * 1000.0)
            await anyio.sleep(hold_s)
            gate.open()
        tg.cancel_scope.cancel()
    return reactions


async def main(args: argparse.Namespace) -> None:
    configure_logging("warning", "console", sys.stderr)
    print(f"loading {args.model} ...", file=sys.stderr)
    model = await anyio.to_thread.run_sync(lambda: load_model(args.model, backend=args.backend, n_ctx=1024))
    ids = model.encode_chat(PROMPT)

    # 1. the gate's cost: no gate vs open gate (alternated, best of 2 each)
    ungated, gated = [], []
    for _ in range(2):
        ungated.append(await decode_tps(model, ids, args.tokens // 2, None))
        gated.append(await decode_tps(model, ids, args.tokens // 2, DecodeGate()))
    tps_ref, tps_gate = max(ungated), max(gated)

    # 2. loop lag idle vs decoding
    idle: list[float] = []
    busy: list[float] = []
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lag_probe, stop, idle)
        await anyio.sleep(1.0)
        stop.set()
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lag_probe, stop, busy)
        await decode_tps(model, ids, args.tokens // 2, DecodeGate())
        stop.set()

    # 3. pause reaction over many pause/resume cycles during one long generation
    gate = DecodeGate()
    model.transformer.kv.tokens = []
    gen = model.generate(ids, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True), gate=gate)
    step_s = 1.0 / max(tps_gate, 1e-6)
    reactions = await pause_reactions(gen, gate, args.cycles, step_s, hold_s=0.02)
    m = gate.metrics()

    p50, p99, step_ms = statistics.median(reactions), pct(reactions, 0.99), step_s * 1000
    lines = [
        f"model {model.info.name} on {model.backend}, {args.cycles} pause cycles, {args.tokens // 2} tokens per speed run",
        f"decode tok/s: no gate {tps_ref:.2f}, open gate {tps_gate:.2f}, ratio gate/no-gate {tps_gate / tps_ref:.3f}",
        f"pause reaction ms (request -> parked): p50 {p50:.1f}  p99 {p99:.1f}  "
        f"(gate metrics p50 {m['reaction_ms_p50']:.1f} p99 {m['reaction_ms_p99']:.1f}); "
        f"mean decode step {step_ms:.1f} ms -> p50 {p50 / step_ms:.2f} steps",
        f"loop lag ms: idle p50 {statistics.median(idle):.2f} p99 {pct(idle, 0.99):.2f}  |  "
        f"decoding p50 {statistics.median(busy):.2f} p99 {pct(busy, 0.99):.2f}  "
        f"(ratio p99 decoding/idle {pct(busy, 0.99) / max(pct(idle, 0.99), 1e-6):.1f})",
    ]
    print("\n".join(lines))
    lag_busy, ratio = pct(busy, 0.99), tps_gate / tps_ref
    figures = {
        "gate_vs_no_gate_decode": (round(ratio, 3), "x"),
        "pause_reaction_p50_ms": (round(p50, 1), "ms"),
        "pause_reaction_p99_ms": (round(p99, 1), "ms"),
        "decode_step_ms": (round(step_ms, 1), "ms"),
        "loop_lag_p99_decoding_ms": (round(lag_busy, 2), "ms"),
    }
    headline = (
        f"pause reaction p50 {p50:.1f} ms / p99 {p99:.1f} ms with a {step_ms:.1f} ms decode step"
        f"{' (within one step)' if p99 <= step_ms else ''}; an open gate costs {ratio:.3f}x decode; "
        f"loop lag p99 {lag_busy:.2f} ms while decoding"
    )
    await anyio.to_thread.run_sync(lambda: save(Path(args.out), lines, figures, headline))


def save(out: Path, lines: list[str], figures: dict[str, tuple[float, str]], headline: str) -> None:
    """Write the result file and record its figures in the results index."""
    command = f"python -m bench.gate {' '.join(sys.argv[1:])}".strip()
    out.write_text(
        f"# bench/gate.py\n\nCommand: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores)\n\n```\n"
        + "\n".join(lines)
        + "\n```\n"
    )
    record(
        "gate",
        out,
        figures,
        reference="no gate and an idle loop, same run",
        headline=headline,
        command="`make bench-gate` (`python -m bench.gate`)",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--backend", default="auto", choices=["auto", "numpy", "native", "cupy"])
    parser.add_argument(
        "--out", default=str(RESULTS / "gate.md"), help="result file (recorded in bench/results/index.json)"
    )
    ns = parser.parse_args()
    if not Path(ns.model).exists():
        raise SystemExit(f"{ns.model} missing: run `genie-supervisor models fetch smollm2`")
    anyio.run(main, ns)
