"""GPU engine benchmark: decode and prefill tokens/s and GPU memory on models it generates itself.

    python -m bench.engine_gpu [--models smollm2,qwen3-4b] [--prompt 512] [--decode 128] [--llama-bench PATH]

The headline is decode through `Model.generate` (what the API serves: `--decode` tokens after a
`--prompt`-token prompt, timed from the consumer's side, first token to last; median of
`--gen-runs`), beside the replay loop (`Model.step_sample` back to back) and the graph replayed
without the host; also `Model.generate` with the decode loop on the device off, same run.
llama.cpp: with `--llama-bench PATH` its `llama-bench` runs on the same generated files in the same
run (`bench.llama_bench`: pp<prompt>, tg<decode> at depth <prompt>); otherwise the figures published
with issue 19 (llama.cpp 0c1e570, H200, same files) are printed and marked as such.
Prints each figure beside llama.cpp's with the ratio and the
fraction of the memory-bandwidth limit (weight bytes per token / measured copy bandwidth);
memory: the plan's parts, what CuPy's pool holds and what CUDA reports in use after the default
path (prefill, decode, generate), next to llama.cpp's figure for the same shape at n_ctx 4096
(estimated by llama.cpp's formula, not measured). Prefill: median of --runs runs per tile
precision (auto, fp32, fp16; alternating, garbage collector off). Writes the numbers to
bench/results/engine_gpu-<time>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from bench import llama_bench
from bench.record import record
from engine import SamplingParams, load_model
from engine.sampler import Sampler
from engine.synth import preset_config, write_config

LLAMA_CPP = {  # tok/s: llama.cpp's published figures (issue 19), replaced by --llama-bench's
    "smollm2": {"preset": "smollm2-135m-q4_1", **llama_bench.PUBLISHED["smollm2"]},
    "qwen3-4b": {"preset": "qwen3-4b-q4_k_m", **llama_bench.PUBLISHED["qwen3-4b"]},
}


def copy_bandwidth(cp) -> float:  # type: ignore[no-untyped-def]
    """Device-to-device copy, bytes read + written per second (the decode ceiling)."""
    a = cp.empty(1 << 30, dtype=cp.uint8)
    b = cp.empty_like(a)
    b[...] = a
    cp.cuda.Device().synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(10):
        b[...] = a
    stop.record()
    stop.synchronize()
    sec = cp.cuda.get_elapsed_time(start, stop) / 1e3 / 10
    del a, b
    return 2 * (1 << 30) / sec


MIB = 2**20


def llama_cpp_memory(gf, spec, n_ctx: int = 4096, n_ubatch: int = 512) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """GPU bytes llama.cpp takes for this model by its own accounting - estimated by llama.cpp's
    formula, not measured: model buffer = the GGUF's tensor bytes (token_embd of an untied model
    stays in host memory; a tied one is duplicated to the GPU as the output head), KV f16 =
    n_layers * n_ctx * n_kv_heads * (head_dim + v_head_dim) * 2, compute buffer = n_ubatch *
    n_vocab * 4 (the logits) + the largest per-layer activations (FFN: gate and up outputs, the
    layer input and the residual, float32 [n_ubatch, ...])."""
    model = sum(t.nbytes for t in gf.tensors.values())
    if "output.weight" in gf.tensors:
        model -= gf.tensors["token_embd.weight"].nbytes
    kv = spec.n_layers * n_ctx * spec.n_kv_heads * (spec.head_dim + spec.v_head_dim) * 2
    compute = n_ubatch * spec.n_vocab * 4 + n_ubatch * 4 * (2 * spec.n_ff + 2 * spec.n_embd)
    return {"model": model, "kv_f16": kv, "compute": compute, "total": model + kv + compute}


def cuda_used(cp) -> int:  # type: ignore[no-untyped-def]
    """Device bytes in use (cudaMemGetInfo: total - free), every allocator and the context."""
    free, total = cp.cuda.runtime.memGetInfo()
    return int(total - free)


def use_prefill_mode(ops, mode: str, mmq: bool) -> None:  # type: ignore[no-untyped-def]
    """Set the prefill precision `mode`; "<dtype>-tiles" is that precision with `mmq_h_<T>` off
    (dequantized tiles + cuBLAS, the path before it); `mmq`: what the backend chose at load."""
    ops.prefill_dtype = mode.removesuffix("-tiles")
    if hasattr(ops, "mmq"):
        ops.mmq = mmq and not mode.endswith("-tiles")


def time_prefill(tf, ops, prompt: list[int], modes: list[str], runs: int, cp, graph: bool = True) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median seconds of one forward pass over `prompt` per prefill tile precision: `runs` rounds,
    each mode once per round (alternating, so drift hits all alike), garbage collector off: a
    full collection with a tokenizer on the heap can take milliseconds, and in a host-bound
    prefill (SmolLM2's shape) it adds to whichever op runs - the likely cause of v4b's single-run
    fp16 profile showing attention at 24 ms instead of 6 (no op there depends on the tiles)."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    mmq = getattr(ops, "mmq", False)

    for mode in modes:  # warm-up: tile buffer, cuBLAS heuristics for this mode's shapes
        use_prefill_mode(ops, mode, mmq)
        tf.forward(prompt, 0, last_n=1, graph=graph)
    cp.cuda.Device().synchronize()
    gc.collect()
    gc.disable()
    try:
        for _ in range(runs):
            for mode in modes:
                use_prefill_mode(ops, mode, mmq)
                t0 = time.perf_counter()
                ops.argmax(tf.forward(prompt, 0, last_n=1, graph=graph))
                cp.cuda.Device().synchronize()
                times[mode].append(time.perf_counter() - t0)
    finally:
        gc.enable()
        use_prefill_mode(ops, "auto", mmq)
    return {m: float(np.median(v)) for m, v in times.items()}


def _generate_stats(m, prompt: list[int], n: int, runs: int = 1, loop: bool | None = None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """`Model.generate`, greedy, `n` tokens after `prompt` (prefilled each run): the medians over
    `runs` of the decode rate timed by the consumer (first token to last: what a client gets),
    the generation's own `stats.decode_tps`, and its prefill rate. `loop`: the decode loop on the
    device on/off (None: as loaded; an engine without the option runs as it is)."""
    from dataclasses import replace

    opts = m.options
    if loop is not None and hasattr(opts, "cupy_device_loop"):
        m.options = replace(opts, cupy_device_loop=loop)

    async def run():  # type: ignore[no-untyped-def]
        g = m.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        times = [time.perf_counter() async for _ in g]  # one event a token, then maybe a text tail
        k = g.stats.completion_tokens
        return (k - 1) / (times[k - 1] - times[0]), g.stats

    walls, stats, prefills = [], [], []
    try:
        for _ in range(runs):
            m.transformer.kv.tokens = []
            wall, st = anyio.run(run)
            walls.append(wall)
            stats.append(st.decode_tps)
            prefills.append(st.prefill_tps)
    finally:
        m.options = opts
    return {"wall": float(np.median(walls)), "stats": float(np.median(stats)), "prefill": float(np.median(prefills))}


PREFILL_OPS = (
    "embed_rows",
    "rms_norm",
    "act_quant",
    "matmul",
    "_mmq",
    "dequant_f16",
    "dequant_f32",
    "_gemm",
    "rope",
    "kv_store",
    "attention",
    "gated_act",
)


def prefill_profile(tf, ops, prompt: list[int], cp, label: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Where one prefill call's time goes: GPU time of each backend op (CUDA events around every
    call; matmul includes its dequantize and GEMM parts), the GPU span of the whole call and the
    host wall time (both inflated a little by the event records)."""
    marks: dict[str, list] = {n: [] for n in PREFILL_OPS}
    orig = {n: getattr(ops, n) for n in PREFILL_OPS if hasattr(ops, n)}

    def wrap(name, fn):  # type: ignore[no-untyped-def]
        def run(*a, **k):  # type: ignore[no-untyped-def]
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            r = fn(*a, **k)
            e1.record()
            marks[name].append((e0, e1))
            return r

        return run

    for n, fn in orig.items():
        setattr(ops, n, wrap(n, fn))
    gc.collect()
    gc.disable()
    try:
        cp.cuda.Device().synchronize()
        s0, s1 = cp.cuda.Event(), cp.cuda.Event()
        t0 = time.perf_counter()
        s0.record()
        tf.forward(prompt, 0, last_n=1, graph=False)  # op by op: the graph would hide the ops
        s1.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        s1.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    finally:
        gc.enable()
        for n in orig:
            delattr(ops, n)
    span = cp.cuda.get_elapsed_time(s0, s1)
    lines = [
        f"  prefill {label} ({len(prompt)} tokens): GPU span {span:.1f} ms, host returns after "
        f"{host_ms:.1f} ms, wall {wall_ms:.1f} ms"
    ]
    for n in PREFILL_OPS:
        if marks[n]:
            each = [cp.cuda.get_elapsed_time(a, b) for a, b in marks[n]]
            ms = sum(each)
            lines.append(
                f"    {n:12} {len(marks[n]):5d} calls {ms:8.2f} ms ({ms / max(span, 1e-9):5.1%} of span), "
                f"longest call {max(each):6.2f} ms"
            )
    return lines


def bench_model(
    key: str,
    path: str,
    prompt_len: int,
    n_decode: int,
    bw: float,
    cp,
    runs: int,  # type: ignore[no-untyped-def]
    profile_out: list[str] | None = None,
    kv_dtype: str = "f16",
    gen_runs: int = 3,
    ref: dict[str, Any] | None = None,
) -> dict:
    from engine.backends.cupy_launch import pdl_launcher
    from engine.gguf_file import read_gguf
    from engine.spec import read_spec

    pool = cp.get_default_memory_pool()
    gc.collect()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    base_pool, base_cuda = pool.total_bytes(), cuda_used(cp)
    t0 = time.perf_counter()
    m = load_model(path, backend="cupy", n_ctx=4096, kv_dtype=kv_dtype)
    load_s = time.perf_counter() - t0
    tf, ops = m.transformer, m.transformer.ops
    plan = m.memory_plan
    prompt = np.random.default_rng(0).integers(0, m.spec.n_vocab, prompt_len).tolist()
    # warm-up (compilation, cuBLAS handles, pool growth)
    tf.forward(prompt[:64], 0, last_n=1)
    for i in range(4):
        tf.forward([prompt[i]], 64 + i, last_n=1)
    # prefill with the default tiles ("auto"), median of `runs`
    prefill_s = time_prefill(tf, ops, prompt, ["auto"], runs, cp)["auto"]
    tok = ops.argmax(tf.forward(prompt, 0, last_n=1))
    # decode through Model.step_sample (what Model.generate calls each step): the CUDA-graph
    # decoder when the backend has one, greedy on the device (only the id comes back)
    sampler = Sampler(SamplingParams(temperature=0))
    tf.kv.tokens = list(prompt)
    hist = list(prompt)
    pos = prompt_len
    for _ in range(3):  # warm-up steps (positions rewritten below)
        m.step_sample(tok, pos, sampler, hist)
    del tf.kv.tokens[prompt_len:]
    tok0 = tok

    def timed_decode(m=m) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
        t, p = tok0, prompt_len
        del m.transformer.kv.tokens[prompt_len:]
        t0 = time.perf_counter()
        for _ in range(n_decode):
            t = m.step_sample(t, p, sampler, hist)
            p += 1
        cp.cuda.Device().synchronize()
        return time.perf_counter() - t0, t, p

    decode_s, tok, pos = timed_decode()
    # the same decode with plain launches (the version before programmatic dependent launch),
    # measured in this run as the reference of the PDL figure
    dec = m.decoder
    plain_s = None
    if dec is not None and dec.pdl:
        dec._set_pdl(None)
        dec._capture()
        plain_s = timed_decode()[0]
        dec._set_pdl(pdl_launcher())
        dec._capture()
    # the step replayed back to back without waiting for each id (GPU time per step; one
    # position, as the host rewrites the pinned id buffer while earlier copies may be queued)
    gpu_tps = None
    if dec is not None:
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(dec.stream)
        for _ in range(n_decode):
            dec._launch(tok, pos)
        stop.record(dec.stream)
        stop.synchronize()
        gpu_tps = n_decode / (cp.cuda.get_elapsed_time(start, stop) / 1e3)
    # end to end: Model.generate (prefill in the backend's 512-token chunks, then decode;
    # worker-thread hops)
    gen = _generate_stats(m, prompt, n_decode, gen_runs)
    stepwise = _generate_stats(m, prompt, n_decode, gen_runs, loop=False)  # one step at a time, same run
    cp.cuda.Device().synchronize()
    # memory after the default path (before the tile-precision comparison below, which grows
    # the tile buffer to fp32 on a model whose plan has fp16 tiles only)
    graphs = getattr(ops, "prefill_graphs", None)  # first-chunk graphs hold their own pools
    held = pool.total_bytes() - base_pool + (graphs.held_bytes if graphs is not None else 0)
    used = cuda_used(cp) - base_cuda
    gf = read_gguf(path)
    llama = llama_cpp_memory(gf, read_spec(gf), 4096, 512)
    # the same prefill with fp32 and fp16 tiles everywhere
    # (and the default precision with dequantized tiles + cuBLAS instead of mmq_h_<T>: the version
    # before the fused GEMMs, same run)
    by_mode = time_prefill(tf, ops, prompt, ["auto", "auto-tiles", "float32", "float16"], runs, cp)
    # the same pass launched op by op (the version before first-chunk graphs), same run
    eager_s = time_prefill(tf, ops, prompt, ["auto"], runs, cp, graph=False)["auto"]
    weights = tf.weights_bytes
    if profile_out is not None:  # prefill phases (each tile precision)
        profile_out.append(f"\n== {key}: prefill phases (garbage collector off)")
        mmq = getattr(ops, "mmq", False)
        for dt in ("float32", "float16-tiles", "auto"):
            use_prefill_mode(ops, dt, mmq)
            tf.forward(prompt, 0, last_n=1, graph=False)
            for ln in prefill_profile(tf, ops, prompt, cp, dt):
                print(ln, flush=True)
                profile_out.append(ln)
        use_prefill_mode(ops, "auto", mmq)
    if profile_out is not None and dec is not None:  # per-launch times (bench/decode_profile.py)
        from bench.decode_profile import profile_model

        profile_model(m, key, prompt_len + n_decode, out=lambda s: (print(s, flush=True), profile_out.append(s)))
    ref = ref or {**LLAMA_CPP[key], "source": "published"}
    decode_tps = n_decode / decode_s  # the replay loop (Model.step_sample back to back)
    gen_tps = gen["wall"]  # the headline: Model.generate as its consumer gets it
    # the figure compared with llama.cpp: the default tiles' median from the alternating rounds
    # below, taken with every buffer and cuBLAS heuristic warm (llama-bench also warms up); the
    # first median (right after load) is kept as prefill_first_tok_s
    prefill_tps = prompt_len / by_mode["auto"]
    limit_tps = bw / weights
    row = {
        "model": key,
        "preset": LLAMA_CPP[key]["preset"],
        "llama_cpp": {k: ref[k] for k in ("decode", "prefill", "source", "decode_depth", "build") if k in ref},
        "load_s": round(load_s, 2),
        "decoder": dec.describe() if dec is not None else None,
        "decode_tok_s": round(decode_tps, 1),
        "decode_gpu_replay_tok_s": round(gpu_tps, 1) if gpu_tps else None,
        "decode_plain_launch_tok_s": round(n_decode / plain_s, 1) if plain_s else None,
        "decode_pdl_vs_plain": round(plain_s / decode_s, 3) if plain_s else None,
        "generate_decode_tok_s": round(gen["stats"], 1),
        "generate_wall_decode_tok_s": round(gen_tps, 1),
        "generate_vs_replay_loop": round(gen_tps / decode_tps, 3),
        "generate_vs_gpu_replay": round(gen_tps / gpu_tps, 3) if gpu_tps else None,
        "generate_stepwise_wall_decode_tok_s": round(stepwise["wall"], 1),
        "generate_device_loop_vs_stepwise": round(gen_tps / stepwise["wall"], 3),
        "generate_runs": gen_runs,
        "generate_prefill_tok_s": round(gen["prefill"], 1),
        "generate_prefill_chunk": int(ops.prefill_chunk),
        "prefill_tok_s": round(prefill_tps, 1),
        "prefill_first_tok_s": round(prompt_len / prefill_s, 1),
        "prefill_graph": bool(graphs is not None and graphs.buckets),
        "prefill_eager_tok_s": round(prompt_len / eager_s, 1),
        "prefill_runs": runs,
        "prefill_auto_tok_s": round(prompt_len / by_mode["auto"], 1),
        "prefill_f32_tok_s": round(prompt_len / by_mode["float32"], 1),
        "prefill_f16_tok_s": round(prompt_len / by_mode["float16"], 1),
        "prefill_mmq": bool(getattr(ops, "mmq", False)),
        "prefill_tiles_tok_s": round(prompt_len / by_mode["auto-tiles"], 1),
        "prefill_vs_tiles": round(by_mode["auto-tiles"] / by_mode["auto"], 3),
        "decode_vs_llama_cpp": round(gen_tps / ref["decode"], 3),
        "replay_loop_vs_llama_cpp": round(decode_tps / ref["decode"], 3),
        "prefill_vs_llama_cpp": round(prefill_tps / ref["prefill"], 3),
        "bandwidth_limit_tok_s": round(limit_tps, 1),
        "decode_fraction_of_limit": round(gen_tps / limit_tps, 3),
        "replay_loop_fraction_of_limit": round(decode_tps / limit_tps, 3),
        "llama_cpp_fraction_of_limit": round(ref["decode"] / limit_tps, 3),
        "weights_bytes": int(weights),
        "kv_bytes": int(tf.kv.nbytes),
        "pool_held_bytes": int(held),
        "cuda_used_bytes": int(used),
        "plan_bytes": int(plan.total),
        "plan_parts": {
            "weights": plan.weights,
            "kv": plan.kv,
            "tables": plan.tables,
            "decode_scratch": plan.decode_scratch,
            "prefill_scratch": plan.prefill_scratch,
            **dict(plan.parts),
        },
        "plan_chunk": plan.chunk,
        "llama_cpp_bytes_estimated": llama,
        "pool_vs_llama_cpp": round(held / llama["total"], 3),
        "plan_vs_llama_cpp": round(plan.total / llama["total"], 3),
        "cuda_used_vs_llama_cpp": round(used / llama["total"], 3),
    }
    m.close()
    del m, tf, ops
    gc.collect()
    pool.free_all_blocks()
    return row


def print_memory(r: dict) -> None:
    """Plan parts, pool, CUDA, llama.cpp's estimate for one result row (MiB)."""
    p, ll = r["plan_parts"], r["llama_cpp_bytes_estimated"]
    print(
        f"{r['model']}: plan {r['plan_bytes'] / MIB:.1f} MiB = "
        + " + ".join(f"{k} {v / MIB:.1f}" for k, v in p.items() if k not in ("prefill_scratch",))
        + f" (prefill chunk {r['plan_chunk']})"
    )
    print(
        f"  pool held {r['pool_held_bytes'] / MIB:.1f} MiB (plan/held {r['plan_bytes'] / r['pool_held_bytes']:.3f}), "
        f"CUDA used {r['cuda_used_bytes'] / MIB:.1f} MiB (cudaMemGetInfo delta: + context, cuBLAS, graph)"
    )
    print(
        f"  llama.cpp (estimated by llama.cpp's formula, not measured): model {ll['model'] / MIB:.1f} + "
        f"KV f16 {ll['kv_f16'] / MIB:.1f} + compute {ll['compute'] / MIB:.1f} = {ll['total'] / MIB:.1f} MiB; "
        f"ours/llama.cpp: pool {r['pool_vs_llama_cpp']:.3f}, plan {r['plan_vs_llama_cpp']:.3f}, "
        f"CUDA used {r['cuda_used_vs_llama_cpp']:.3f}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,qwen3-4b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--workdir", default=None, help="where the generated models go (temp dir)")
    ap.add_argument("--profile", action="store_true", help="also time each decode launch")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--runs", type=int, default=5, help="timed prefill runs per tile precision (median)")
    ap.add_argument("--kv", default="f16", help="KV cache types to run, comma-separated (f16, int8, f32)")
    ap.add_argument("--gen-runs", type=int, default=3, help="Model.generate runs per mode (median)")
    ap.add_argument("--llama-bench", default=None, help="a llama.cpp llama-bench binary to run on the same files")
    a = ap.parse_args()
    import cupy as cp

    dev = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    bw = copy_bandwidth(cp)
    print(f"device {name}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    prof: list[str] = []
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        for key in a.models.split(","):
            path = os.path.join(tmp, key + ".gguf")
            t0 = time.perf_counter()
            write_config(path, preset_config(LLAMA_CPP[key]["preset"], fast=True))
            print(
                f"{key}: generated {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True
            )
            ref = None
            if a.llama_bench:
                ref = {
                    **llama_bench.measure(a.llama_bench, path, a.prompt, a.decode),
                    "source": "llama-bench, same run",
                }
                print(f"{key}: llama-bench {ref}", flush=True)
            for kv in a.kv.split(","):
                row = bench_model(
                    key,
                    path,
                    a.prompt,
                    a.decode,
                    bw,
                    cp,
                    a.runs,
                    prof if a.profile and kv == "f16" else None,
                    kv,
                    a.gen_runs,
                    ref,
                )
                row["kv_dtype"] = kv
                rows.append(row)
                print(json.dumps(row), flush=True)
            os.remove(path)
    print()
    for r in rows:
        print(
            f"{r['model']} (KV {r['kv_dtype']}): decode via Model.generate {r['generate_wall_decode_tok_s']} tok/s "
            f"(consumer's clock; stats {r['generate_decode_tok_s']}), replay loop {r['decode_tok_s']} "
            f"({r['generate_vs_replay_loop']:.3f}x), GPU replay {r['decode_gpu_replay_tok_s']} "
            f"({r['generate_vs_gpu_replay']}x); one step at a time {r['generate_stepwise_wall_decode_tok_s']} "
            f"(device loop {r['generate_device_loop_vs_stepwise']:.3f}x); decoder {r['decoder']}"
        )
        print(
            f"  prefill (median of {r['prefill_runs']}): auto {r['prefill_auto_tok_s']} (mmq {r['prefill_mmq']}; "
            f"auto with dequantized tiles + cuBLAS, same run: {r['prefill_tiles_tok_s']}, "
            f"{r['prefill_vs_tiles']:.2f}x), fp32 {r['prefill_f32_tok_s']}, fp16 {r['prefill_f16_tok_s']} tok/s; via Model.generate "
            f"({r['generate_prefill_chunk']}-token chunks) {r['generate_prefill_tok_s']} tok/s"
        )
        print_memory(r)
    sources = sorted({r["llama_cpp"]["source"] for r in rows})
    print(
        "llama.cpp: "
        + (
            "measured in this run (llama-bench, same files)"
            if sources == ["llama-bench, same run"]
            else "the figures published with issue 19 (llama.cpp 0c1e570, same H200, same generated files), "
            "NOT measured in this run (give --llama-bench PATH to measure)"
        )
    )
    print(
        f"{'model':10} {'KV':>4} {'generate':>9} {'replay':>7} {'gen/rep':>7} {'llama.cpp':>9} {'ratio':>6} {'of limit':>8} "
        f"{'prefill tok/s':>13} {'llama.cpp':>9} {'ratio':>6} {'GPU MiB':>8}"
    )
    for r in rows:
        ref = r["llama_cpp"]
        print(
            f"{r['model']:10} {r['kv_dtype']:>4} {r['generate_wall_decode_tok_s']:9.1f} {r['decode_tok_s']:7.1f} "
            f"{r['generate_vs_replay_loop']:7.3f} {ref['decode']:9.0f} {r['decode_vs_llama_cpp']:6.2f} "
            f"{r['decode_fraction_of_limit']:8.1%} {r['prefill_tok_s']:13.1f} {ref['prefill']:9.0f} "
            f"{r['prefill_vs_llama_cpp']:6.2f} {r['pool_held_bytes'] / 2**20:8.0f}"
        )
        if r["prefill_graph"]:
            print(
                f"{'':15} prefill op by op (same run): {r['prefill_eager_tok_s']:.1f} tok/s, first-chunk graph "
                f"{r['prefill_tok_s'] / r['prefill_eager_tok_s']:.2f}x"
            )
        if r["decode_plain_launch_tok_s"]:
            print(
                f"{'':15} plain launches (same run): {r['decode_plain_launch_tok_s']:.1f} tok/s, "
                f"PDL {r['decode_pdl_vs_plain']:.3f}x"
            )
    Path(a.out).mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {
        "device": name,
        "copy_bandwidth_Bps": bw,
        "prompt": a.prompt,
        "decode": a.decode,
        "version": "cupy-v10 (decode: the q8_k input rounding and qkv_post load their weights and RoPE row before the wait for the kernel before) over cupy-v9 (prefill: fp16 GEMMs read the GGUF blocks, mmq_h_<T>, no dequantized tiles; the tile path measured in the same run) over cupy-v8 (decode loop on the device: Model.generate chains steps, the next reading the previous one's token from device memory, one step queued ahead, tokens read one step behind) over cupy-v7 (decode: programmatic dependent launch between the step's kernels, GEMVs load their first weights and attention asks for its K/V rows before waiting; prefill: a prompt's first chunk replayed from a CUDA graph for models < 1 GiB (op by op measured in the same run); integer GEMV unroll 2 (GLU 1) and threads a row chosen with weights from DRAM; the plain-launch step measured in the same run) over cupy-v5 (decode: attention with q in registers, one-ahead prefetch, parallel merge, O-projection rounding fused (no qprep), int8 KV option; prefill: auto tiles (fp16 for matrices >= 4M values), attention in query blocks by strided-batched GEMMs, 512-token chunks in generate; memory plan of the GPU backend; device sampling)",
        "rows": rows,
    }
    tag = f"-{a.tag}" if a.tag else ""
    if prof:
        (Path(a.out) / f"decode_profile-{stamp}{tag}.txt").write_text("\n".join(prof) + "\n")
    out = Path(a.out) / f"engine_gpu-{stamp}{tag}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    _record(out, rows, a.tag)
    return 0


def _record(out: Path, rows: list[dict[str, Any]], tag: str) -> None:
    """The f16-KV rows' decode and prefill against llama.cpp into the results index."""
    f16 = [r for r in rows if r["kv_dtype"] == "f16"]
    figures: dict[str, tuple[float, str]] = {}
    for r in f16:
        m = r["model"]
        figures |= {
            f"{m}.decode_tok_s": (round(r["generate_wall_decode_tok_s"], 1), "tok/s"),
            f"{m}.replay_loop_tok_s": (round(r["decode_tok_s"], 1), "tok/s"),
            f"{m}.decode_vs_llama_cpp": (round(r["decode_vs_llama_cpp"], 3), "x"),
            f"{m}.prefill_tok_s": (round(r["prefill_tok_s"], 1), "tok/s"),
            f"{m}.prefill_vs_llama_cpp": (round(r["prefill_vs_llama_cpp"], 3), "x"),
        }
    shapes = {"smollm2": "SmolLM2 shape", "qwen3-4b": "Qwen3-4B shape"}
    parts = [
        f"{shapes.get(r['model'], r['model'])} {r['generate_wall_decode_tok_s']:,.0f} tok/s decode through "
        f"Model.generate ({r['decode_vs_llama_cpp']:.2f}x; replay loop {r['decode_tok_s']:,.0f}), "
        f"{r['prefill_tok_s']:,.0f} prefill ({r['prefill_vs_llama_cpp']:.2f}x)"
        for r in f16
    ]
    record(
        "engine_gpu",
        out,
        figures,
        reference="llama.cpp on the same shape (" + ", ".join(sorted({r["llama_cpp"]["source"] for r in f16})) + ")",
        headline=f"{tag + ', ' if tag else ''}f16 KV, vs llama.cpp: " + "; ".join(parts),
        command="`python -m bench.engine_gpu`",
    )


if __name__ == "__main__":
    raise SystemExit(main())
