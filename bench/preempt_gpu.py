"""Preemption on the GPU: prefill speed with layer-group gate checks vs the previous engine, and
pause reaction (gate.pause() -> engine parked) while decoding and while prefilling.

    python -m bench.preempt_gpu --prev .prev [--out DIR] [--groups 4,9] [--cycles 40]

`--prev` is a folder holding the previous commit's engine as the package `engine_prev`
(`git archive HEAD~1 engine | tar -x -C .prev && mv .prev/engine .prev/engine_prev`): both
engines load the same generated models in this one process and their prefills alternate, so
the ratio is same-run. Prefill: a 512-token prompt through `Model.generate` (one 512-token chunk,
max_tokens 1), `stats.prefill_s`, median of --runs. Reaction: measured as bench/gate.py does
(monotonic time at `gate.pause()` to `wait_parked` returning), the pause landing at a random
point inside a decode step, or inside a 2,048-token prefill (512-token chunks, layer groups of G).
Writes results.json and summary.md to --out (bench/results/preempt_gpu-<time>/) and, on CuPy, records
the headline in bench/results/index.json.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from bench.gate import pause_reactions
from bench.record import record
from engine import SamplingParams, load_model
from engine.synth import preset_config, write_config
from genie_supervisor.arbiter import DecodeGate

PRESETS = {"qwen3-4b": "qwen3-4b-q4_k_m", "smollm2": "smollm2-135m-q4_1"}


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] if s else float("nan")


async def aprefill_s(model: Any, ids: list[int], chunk: int, group: int | None) -> float:
    """Seconds of one prefill through Model.generate (no prefix cache)."""
    model.transformer.kv.tokens = []
    kw = {} if group is None else {"prefill_layer_group": group}
    gen = model.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), prefill_chunk=chunk, **kw)
    async for _ in gen:
        pass
    return float(gen.stats.prefill_s)


def prev_has_groups(model: Any) -> bool:
    """Whether the previous engine's `generate` takes `prefill_layer_group`."""
    import inspect

    return "prefill_layer_group" in inspect.signature(model.generate).parameters


def pipelined(model: Any) -> bool:
    """Whether the engine keeps one layer-group piece queued ahead (`Model.prefill_settle`):
    a pause then lands within the running piece plus the queued one."""
    return hasattr(model, "prefill_settle") and hasattr(model.transformer.ops, "mark")


def prefill_s(model: Any, ids: list[int], chunk: int, group: int | None) -> float:
    return anyio.run(aprefill_s, model, ids, chunk, group)


def speed(new: Any, old: Any, n_vocab: int, groups: list[int], runs: int, new_b: Any = None) -> dict[str, Any]:
    """Median prefill tok/s of a 512-token prompt per variant, variants alternating each round;
    `new_b`: a second copy of the new engine's model loaded after the previous engine's (an A/A
    control: what load order alone does)."""
    ids = np.random.default_rng(0).integers(0, n_vocab, 512).tolist()
    variants: dict[str, tuple[Any, int, int | None]] = {
        "prev_chunk512": (old, 512, None),
        "new_chunk512": (new, 512, 0),
        **({"new_chunk512_loaded_after_prev": (new_b, 512, 0)} if new_b is not None else {}),
        **{f"new_chunk512_group{g}": (new, 512, g) for g in groups},
        **{f"prev_chunk512_group{g}": (old, 512, g) for g in groups if prev_has_groups(old)},
        "prev_chunk64": (old, 64, None),
        "new_chunk64": (new, 64, 0),
    }
    for m, c, g in variants.values():  # warm-up (graphs, cuBLAS, tiles)
        prefill_s(m, ids, c, g)
    times: dict[str, list[float]] = {k: [] for k in variants}
    gc.collect()
    gc.disable()
    try:
        for _ in range(runs):
            for k, (m, c, g) in variants.items():
                times[k].append(prefill_s(m, ids, c, g))
    finally:
        gc.enable()
    tps = {k: 512 / float(np.median(v)) for k, v in times.items()}
    best = {k: 512 / float(np.min(v)) for k, v in times.items()}
    ratios = {k: tps[k] / tps["prev_chunk512"] for k in tps if k.startswith("new_chunk512")}
    ratios.update(
        {
            f"new_chunk512_group{g}_vs_prev_group{g}": tps[f"new_chunk512_group{g}"] / tps[f"prev_chunk512_group{g}"]
            for g in groups
            if f"prev_chunk512_group{g}" in tps
        }
    )
    ratios["new_chunk64"] = tps["new_chunk64"] / tps["prev_chunk64"]
    return {
        "prefill_tps": tps,
        "ratio_to_prev": ratios,
        "runs": runs,
        "prefill_tps_best": best,
        "prefill_ms_all": {k: [round(x * 1000, 3) for x in v] for k, v in times.items()},
    }


async def decode_reaction(model: Any, cycles: int, n_vocab: int) -> dict[str, Any]:
    ids = np.random.default_rng(1).integers(0, n_vocab, 64).tolist()
    model.transformer.kv.tokens = []
    gen = model.generate(ids, SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True))
    n = 0
    async for _ in gen:  # open run: the step time
        n += 1
        if n >= 200:
            break
    await gen.aclose()
    step_ms = 1000.0 / gen.stats.decode_tps
    gate = DecodeGate()
    model.transformer.kv.tokens = []
    gen = model.generate(ids, SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True), gate=gate)
    reactions = await pause_reactions(gen, gate, cycles, step_ms / 1000, hold_s=0.01)
    return {
        "decode_step_ms": step_ms,
        "reaction_ms_p50": statistics.median(reactions),
        "reaction_ms_p99": pct(reactions, 0.99),
        "reaction_ms_max": max(reactions),
        "n": len(reactions),
    }


async def prefill_reaction(model: Any, cycles: int, n_vocab: int, group: int, n_prompt: int = 2048) -> dict[str, Any]:
    """Pauses landing at a random point of a 2,048-token prefill; piece = one worker-thread call
    (a layer group, or a whole chunk with group 0) timed on the host, GPU work finished."""
    ids = np.random.default_rng(2).integers(0, n_vocab, n_prompt).tolist()
    pieces: list[float] = []
    names = ("prefill_layers", "prefill_pass", "step_logits")
    orig = {n: getattr(model, n) for n in names}

    def timed(fn: Any) -> Any:
        def run(*a: Any) -> Any:
            t0 = time.perf_counter()
            r = fn(*a)
            pieces.append((time.perf_counter() - t0) * 1000.0)
            return r

        return run

    for n in names:
        setattr(model, n, timed(orig[n]))
    full = [await aprefill_s(model, ids, 512, group) for _ in range(2)][-1] * 1000.0
    pieces.clear()
    rng = random.Random(1)
    reactions: list[float] = []
    outside = 0
    try:
        for _ in range(cycles):
            gate = DecodeGate()
            model.transformer.kv.tokens = []
            gen = model.generate(
                ids,
                SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                gate=gate,
                prefill_chunk=512,
                prefill_layer_group=group,
            )
            async with anyio.create_task_group() as tg:

                async def consume(gen: Any = gen) -> None:
                    async for _ in gen:
                        pass

                tg.start_soon(consume)
                await anyio.sleep(rng.uniform(0.05, 0.85) * full / 1000)
                t0 = time.monotonic()
                gate.pause({"bench"}, cause_ts=t0)
                parked = await gate.wait_parked(30)
                ms = (time.monotonic() - t0) * 1000.0
                if parked and gate.metrics()["parked_generations"] == 1 and gen.stats.first_token_s is None:
                    reactions.append(ms)  # parked inside the prefill
                else:
                    outside += 1  # the prefill ended first: not a prefill reaction
                gate.open()
    finally:
        for n in names:
            setattr(model, n, orig[n])
    n_pieces = -(-n_prompt // 512) * (-(-len(model.transformer.layers) // group) if group else 1)
    ahead = 1 if group and pipelined(model) else 0
    return {
        "group": group,
        "prefill_ms": full,
        "pieces": n_pieces,
        "pieces_queued_ahead": ahead,
        "piece_gpu_ms": full / n_pieces,
        "bound_ms": (1 + ahead) * pct(pieces, 0.99) + 2,
        "piece_ms_p50": statistics.median(pieces),
        "piece_ms_p99": pct(pieces, 0.99),
        "piece_ms_max": max(pieces),
        "reaction_ms_p50": statistics.median(reactions),
        "reaction_ms_p99": pct(reactions, 0.99),
        "reaction_ms_max": max(reactions),
        "n": len(reactions),
        "not_inside_prefill": outside,
    }


SMOKE_SHAPE: dict[str, Any] = {
    "n_layers": 4,
    "n_embd": 256,
    "n_ff": 512,
    "n_heads": 4,
    "n_kv_heads": 2,
    "n_vocab": 512,
    "head_dim": None,
}
"""Off CuPy (a smoke run of this script): a small model of the same architecture."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prev", required=True)
    ap.add_argument("--out", default=f"bench/results/preempt_gpu-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--models", default="qwen3-4b,smollm2")
    ap.add_argument("--groups", default="4,9")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--backend", default="cupy", help="numpy: a CPU smoke run of this script")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.prev).resolve()))
    prev = importlib.import_module("engine_prev")
    groups = [int(g) for g in a.groups.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"groups": groups}
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        for key in a.models.split(","):
            path = str(Path(tmp) / f"{key}.gguf")
            t0 = time.time()
            cfg = preset_config(PRESETS[key], fast=True, **(SMOKE_SHAPE if a.backend != "cupy" else {}))
            write_config(path, cfg)
            new = load_model(path, backend=a.backend, n_ctx=4096, kv_dtype="f16")
            old = prev.load_model(path, backend=a.backend, n_ctx=4096, kv_dtype="f16")
            new_b = load_model(path, backend=a.backend, n_ctx=4096, kv_dtype="f16")
            print(f"{key}: generated + loaded three times in {time.time() - t0:.0f} s", flush=True)
            r: dict[str, Any] = {
                "layers": len(new.transformer.layers),
                "first_chunk_graph": getattr(new.transformer.ops, "prefill_graphs", None) is not None,
            }
            r["speed"] = speed(new, old, new.spec.n_vocab, groups, a.runs, new_b)
            print(key, json.dumps(r["speed"]), flush=True)
            del old, new_b
            gc.collect()
            if key == a.models.split(",")[0]:
                r["decode"] = anyio.run(decode_reaction, new, a.cycles, new.spec.n_vocab)
                print(key, "decode", json.dumps(r["decode"]), flush=True)
                r["prefill"] = [anyio.run(prefill_reaction, new, a.cycles, new.spec.n_vocab, g) for g in [0, *groups]]
                for p in r["prefill"]:
                    print(key, "prefill", json.dumps(p), flush=True)
            res[key] = r
            del new
            gc.collect()
    (out / "results.json").write_text(json.dumps(res, indent=1))
    lines = ["# Preemption on the GPU (bench/preempt_gpu.py)", ""]
    for key in a.models.split(","):
        r = res[key]
        lines.append(f"## {key} ({r['layers']} layers, first-chunk graph: {r['first_chunk_graph']})")
        lines.append("")
        lines.append(
            "| prefill variant (512-token prompt) | tok/s (median) | best | vs previous engine, whole chunk (median) "
            "| vs previous engine, same groups |"
        )
        lines.append("|---|---|---|---|---|")
        sp = r["speed"]
        for k, v in sp["prefill_tps"].items():
            ratio = sp["ratio_to_prev"].get(k)
            same = next((x for n, x in sp["ratio_to_prev"].items() if n.startswith(k + "_vs_prev_group")), None)
            lines.append(
                f"| {k} | {v:.0f} | {sp['prefill_tps_best'][k]:.0f} | {'' if ratio is None else f'{ratio:.3f}'} "
                f"| {'' if same is None else f'{same:.3f}'} |"
            )
        if "decode" in r:
            d = r["decode"]
            lines += [
                "",
                f"Decoding: step {d['decode_step_ms']:.2f} ms, pause reaction p50 {d['reaction_ms_p50']:.2f} "
                f"ms, p99 {d['reaction_ms_p99']:.2f} ms (bound: step + 2 = {d['decode_step_ms'] + 2:.2f}; "
                f"{'PASS' if d['reaction_ms_p99'] <= d['decode_step_ms'] + 2 else 'FAIL'}), n {d['n']}",
                "",
                "| prefill 2,048 tokens, chunk 512, layer group | prefill ms | piece (GPU, mean) ms | pieces queued ahead | "
                "host call p50 / p99 ms | reaction p50 / p99 ms | bound ((1 + ahead) x host call p99 + 2) | pauses parked inside / after the prefill |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for p in r["prefill"]:
                ok = "PASS" if p["reaction_ms_p99"] <= p["bound_ms"] else "FAIL"
                lines.append(
                    f"| {p['group'] or 'whole chunk'} | {p['prefill_ms']:.1f} | {p['piece_gpu_ms']:.2f} | "
                    f"{p['pieces_queued_ahead']} | {p['piece_ms_p50']:.2f} / {p['piece_ms_p99']:.2f} | "
                    f"{p['reaction_ms_p50']:.2f} / {p['reaction_ms_p99']:.2f} | {p['bound_ms']:.2f} {ok} | "
                    f"{p['n']} / {p['not_inside_prefill']} |"
                )
        lines.append("")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if a.backend == "cupy":
        _record(out, res, a.models.split(",")[0], groups[0], a.runs)


def _record(out: Path, res: dict[str, Any], key: str, group: int, runs: int) -> None:
    """The first model's pause reaction in layer groups and its prefill cost into the results index."""
    p = next(p for p in res[key]["prefill"] if p["group"] == group)
    best = res[key]["speed"]["prefill_tps_best"]
    ratio = best[f"new_chunk512_group{group}"] / best["prev_chunk512"]
    record(
        "preempt_gpu",
        out,
        {
            "pause_p99_ms": (round(p["reaction_ms_p99"], 1), "ms"),
            "prefill_vs_whole_chunks": (round(ratio, 3), "x"),
        },
        reference="the previous engine's whole-chunk prefill, same run",
        headline=f"{key}, layer groups of {group} with {p['pieces_queued_ahead']} piece(s) queued: pause p99 "
        f"{p['reaction_ms_p99']:.1f} ms, prefill {ratio:.3f}x whole chunks (best of {runs})",
        command="`python -m bench.preempt_gpu`",
    )


if __name__ == "__main__":
    main()
