"""GPU engine benchmark: decode and prefill tokens/s and GPU memory on models it generates itself.

    python bench/engine_gpu.py [--models smollm2,qwen3-4b] [--prompt 512] [--decode 128]

Shapes and llama.cpp's figures (commit 0c1e570, CUDA, flash attention, H200, same shapes,
random weights) come from issue 7. Prints each figure beside llama.cpp's with the ratio and the
fraction of the memory-bandwidth limit (weight bytes per token / measured copy bandwidth);
writes the numbers to bench/results/engine_gpu-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402

from engine import SamplingParams, load_model  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.synth import preset_config, write_config  # noqa: E402

LLAMA_CPP = {  # tok/s, issue 7
    "smollm2": {"preset": "smollm2-135m-q4_1", "decode": 929.0, "prefill": 43000.0},
    "qwen3-4b": {"preset": "qwen3-4b-q4_k_m", "decode": 333.0, "prefill": 12600.0},
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


def _generate_stats(m, prompt: list[int], n: int):  # type: ignore[no-untyped-def]
    async def run():  # type: ignore[no-untyped-def]
        g = m.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        async for _ in g:
            pass
        return g.stats

    m.transformer.kv.tokens = []
    return anyio.run(run)


PREFILL_OPS = ("embed_rows", "rms_norm", "act_quant", "matmul", "dequant_f16", "dequant_f32", "_gemm",
               "rope", "kv_store", "attention", "gated_act")


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
    try:
        cp.cuda.Device().synchronize()
        s0, s1 = cp.cuda.Event(), cp.cuda.Event()
        t0 = time.perf_counter()
        s0.record()
        tf.forward(prompt, 0, last_n=1)
        s1.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        s1.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    finally:
        for n in orig:
            delattr(ops, n)
    span = cp.cuda.get_elapsed_time(s0, s1)
    lines = [f"  prefill {label} ({len(prompt)} tokens): GPU span {span:.1f} ms, host returns after "
             f"{host_ms:.1f} ms, wall {wall_ms:.1f} ms"]
    for n in PREFILL_OPS:
        if marks[n]:
            ms = sum(cp.cuda.get_elapsed_time(a, b) for a, b in marks[n])
            lines.append(f"    {n:12} {len(marks[n]):5d} calls {ms:8.2f} ms ({ms / max(span, 1e-9):5.1%} of span)")
    return lines


def bench_model(key: str, path: str, prompt_len: int, n_decode: int, bw: float, cp,  # type: ignore[no-untyped-def]
                profile_out: list[str] | None = None) -> dict:
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    base_used = pool.used_bytes()
    t0 = time.perf_counter()
    m = load_model(path, backend="cupy", n_ctx=4096, kv_dtype="f16")
    load_s = time.perf_counter() - t0
    tf, ops = m.transformer, m.transformer.ops
    prompt = np.random.default_rng(0).integers(0, m.spec.n_vocab, prompt_len).tolist()
    # warm-up (compilation, cuBLAS handles, pool growth)
    tf.forward(prompt[:64], 0, last_n=1)
    for i in range(4):
        tf.forward([prompt[i]], 64 + i, last_n=1)
    cp.cuda.Device().synchronize()
    # prefill
    t0 = time.perf_counter()
    logits = tf.forward(prompt, 0, last_n=1)
    tok = ops.argmax(logits)
    cp.cuda.Device().synchronize()
    prefill_s = time.perf_counter() - t0
    # the same prefill with fp16 tiles (faster, less exact: see cupy_backend)
    ops._scratch, ops.prefill_dtype = None, np.dtype("float16")
    tf.forward(prompt[:64], 0, last_n=1)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    ops.argmax(tf.forward(prompt, 0, last_n=1))
    cp.cuda.Device().synchronize()
    prefill16_s = time.perf_counter() - t0
    # decode through Model.step_sample (what Model.generate calls each step): the CUDA-graph
    # decoder when the backend has one, greedy on the device (only the id comes back)
    sampler = Sampler(SamplingParams(temperature=0))
    tf.kv.tokens = list(prompt)
    hist = list(prompt)
    pos = prompt_len
    for _ in range(3):  # warm-up steps (positions rewritten below)
        m.step_sample(tok, pos, sampler, hist)
    del tf.kv.tokens[prompt_len:]
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = m.step_sample(tok, pos, sampler, hist)
        pos += 1
    cp.cuda.Device().synchronize()
    decode_s = time.perf_counter() - t0
    # the step replayed back to back without waiting for each id (GPU time per step; one
    # position, as the host rewrites the pinned id buffer while earlier copies may be queued)
    gpu_tps = None
    dec = m.decoder
    if dec is not None:
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(dec.stream)
        for _ in range(n_decode):
            dec._launch(tok, pos)
        stop.record(dec.stream)
        stop.synchronize()
        gpu_tps = n_decode / (cp.cuda.get_elapsed_time(start, stop) / 1e3)
    # end to end: Model.generate (prefill in 64-token chunks, then decode; worker-thread hops)
    gen_stats = _generate_stats(m, prompt, n_decode)
    weights = tf.weights_bytes
    held = pool.total_bytes()
    if profile_out is not None:  # prefill phases (fp32 and fp16 tiles)
        profile_out.append(f"\n== {key}: prefill phases")
        for dt in ("float32", "float16"):
            ops._scratch, ops.prefill_dtype = None, np.dtype(dt)
            tf.forward(prompt[:64], 0, last_n=1)
            for ln in prefill_profile(tf, ops, prompt, cp, dt):
                print(ln, flush=True)
                profile_out.append(ln)
        ops._scratch, ops.prefill_dtype = None, np.dtype("float32")
    if profile_out is not None and dec is not None:  # per-launch times (bench/decode_profile.py)
        from decode_profile import profile_model

        profile_model(m, key, prompt_len + n_decode, out=lambda s: (print(s, flush=True), profile_out.append(s)))
    ref = LLAMA_CPP[key]
    decode_tps = n_decode / decode_s
    prefill_tps = prompt_len / prefill_s
    limit_tps = bw / weights
    row = {
        "model": key,
        "preset": ref["preset"],
        "load_s": round(load_s, 2),
        "decoder": dec.describe() if dec is not None else None,
        "decode_tok_s": round(decode_tps, 1),
        "decode_gpu_replay_tok_s": round(gpu_tps, 1) if gpu_tps else None,
        "generate_decode_tok_s": round(gen_stats.decode_tps, 1),
        "generate_prefill_tok_s": round(gen_stats.prefill_tps, 1),
        "prefill_tok_s": round(prefill_tps, 1),
        "prefill_f16_tok_s": round(prompt_len / prefill16_s, 1),
        "decode_vs_llama_cpp": round(decode_tps / ref["decode"], 3),
        "prefill_vs_llama_cpp": round(prefill_tps / ref["prefill"], 3),
        "bandwidth_limit_tok_s": round(limit_tps, 1),
        "decode_fraction_of_limit": round(decode_tps / limit_tps, 3),
        "llama_cpp_fraction_of_limit": round(ref["decode"] / limit_tps, 3),
        "weights_bytes": int(weights),
        "kv_bytes": int(tf.kv.nbytes),
        "pool_held_bytes": int(held - base_used),
        "plan_bytes": int(m.memory_plan.total),
    }
    m.close()
    del m, tf, ops, logits
    pool.free_all_blocks()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,qwen3-4b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--workdir", default=None, help="where the generated models go (temp dir)")
    ap.add_argument("--profile", action="store_true", help="also time each decode launch")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
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
            print(f"{key}: generated {os.path.getsize(path) / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
            row = bench_model(key, path, a.prompt, a.decode, bw, cp, prof if a.profile else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
            os.remove(path)
    print()
    for r in rows:
        print(f"{r['model']}: decode via Model.generate {r['generate_decode_tok_s']} tok/s, "
              f"GPU replay {r['decode_gpu_replay_tok_s']} tok/s, decoder {r['decoder']}")
    print(f"{'model':10} {'decode tok/s':>12} {'llama.cpp':>9} {'ratio':>6} {'of limit':>8} "
          f"{'prefill tok/s':>13} {'llama.cpp':>9} {'ratio':>6} {'GPU MiB':>8}")
    for r in rows:
        ref = LLAMA_CPP[r["model"]]
        print(f"{r['model']:10} {r['decode_tok_s']:12.1f} {ref['decode']:9.0f} {r['decode_vs_llama_cpp']:6.2f} "
              f"{r['decode_fraction_of_limit']:8.1%} {r['prefill_tok_s']:13.1f} {ref['prefill']:9.0f} "
              f"{r['prefill_vs_llama_cpp']:6.2f} {r['pool_held_bytes'] / 2**20:8.0f}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {"device": name, "copy_bandwidth_Bps": bw, "prompt": a.prompt, "decode": a.decode,
              "version": "cupy-v4 (decode: input rounded once per matrix (qprep_x) + int8 dp4a GEMV, 8 threads a row for heads; prefill: GemmEx per tile into the output, vector-store dequant)", "rows": rows}
    tag = f"-{a.tag}" if a.tag else ""
    if prof:
        (Path(a.out) / f"decode_profile-{stamp}{tag}.txt").write_text("\n".join(prof) + "\n")
    out = Path(a.out) / f"engine_gpu-{stamp}{tag}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
