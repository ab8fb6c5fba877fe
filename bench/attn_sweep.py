"""Decode attention (`attn_decode` of engine.kernels.decode_src) alone: GPU time per launch for
the SmolLM2-135M and Qwen3-4B head shapes, f16 and int8 caches, several slice sizes and positions.

    python -m bench.attn_sweep [--chunks 32,64,128] [--pos 640,2048,4000] [--cluster 0,8] [--out DIR]

Each timing is a CUDA graph of one launch per layer, every layer its own cache (as in a real
step, so the cache is not served from L2 by the previous launch), replayed 3 times. Every
configuration is first checked against a float64 reference on the host.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np

from bench.record import record

SHAPES = {  # heads, kv heads, head size, layers
    "smollm2": (9, 3, 64, 30),
    "qwen3-4b": (32, 8, 128, 36),
}


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int, scale: float) -> np.ndarray:
    h, d = q.shape
    kvh = k.shape[0]
    g = h // kvh
    out = np.empty((h, v.shape[-1]))
    for i in range(h):
        kk, vv = k[i // g, : pos + 1].astype(np.float64), v[i // g, : pos + 1].astype(np.float64)
        sc = kk @ q[i].astype(np.float64) * scale
        w = np.exp(sc - sc.max())
        out[i] = (w / w.sum()) @ vv
    return out


def _caches(shape: str, kv: str, n_ctx: int) -> tuple[list, np.ndarray, np.ndarray]:
    """Per-layer device caches (values, values, scales, scales) + layer 0's float reference."""
    import cupy as cp

    from engine.kv_cache import dequantize_rows, quantize_rows

    h, kvh, d, n_layers = SHAPES[shape]
    rng = np.random.default_rng(0)
    layers, kref, vref = [], None, None
    for i in range(n_layers):
        kf = rng.standard_normal((kvh, n_ctx, d), dtype=np.float32)
        vf = rng.standard_normal((kvh, n_ctx, d), dtype=np.float32)
        if kv == "int8":
            (kq, kd), (vq, vd) = quantize_rows(np, kf), quantize_rows(np, vf)
            layers.append([cp.asarray(kq), cp.asarray(vq), cp.asarray(kd), cp.asarray(vd)])
            if i == 0:
                kref, vref = dequantize_rows(np, kq, kd), dequantize_rows(np, vq, vd)
        else:
            kh, vh = kf.astype(np.float16), vf.astype(np.float16)
            layers.append([cp.asarray(kh), cp.asarray(vh), None, None])
            if i == 0:
                kref, vref = kh.astype(np.float32), vh.astype(np.float32)
    assert kref is not None and vref is not None
    return layers, kref, vref


def run(
    shape: str,
    kv: str,
    chunk: int,
    pos: int,
    caches: tuple,
    n_ctx: int = 4096,
    stage: int = 0,
    lanes: int | None = None,
    warps: int | None = None,
    cluster: int = 0,
    cluster_min: int = 192,
) -> dict:
    import cupy as cp

    from engine.kernels import decode_src

    h, kvh, d, n_layers = SHAPES[shape]
    layers, kref, vref = caches
    n_sm = int(cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"])
    n_split = decode_src.attn_split(n_sm, kvh)
    src = decode_src.source(
        ["Q8_0"],
        n_heads=h,
        n_kv_heads=kvh,
        head_dim=d,
        v_head_dim=d,
        rope_half=d // 2,
        neox=True,
        kv_half=kv == "f16",
        n_split=n_split,
        kv_int8=kv == "int8",
        min_chunk=chunk,
        lanes_per_pos=lanes,
        warps=warps,
        attn_cluster=cluster,
        cluster_min=cluster_min,
    )
    if stage:  # profiling: stop the kernel early (1: after the scan, 2: after the slice writes)
        src = f"#define ATT_STAGE {stage}\n" + src
    fn = cp.RawModule(code=src, options=("--std=c++17",)).get_function("attn_decode")
    nw = warps or decode_src.attn_warps(h // kvh, d, cluster)
    blocks = decode_src.attn_blocks(n_split, cluster)
    rng = np.random.default_rng(1)
    q = cp.asarray(rng.standard_normal((h, d)).astype(np.float32))
    ids = cp.asarray(np.array([0, pos, 0, 0], dtype=np.int32))
    pm = cp.zeros(h * n_split, cp.float32)
    pl = cp.zeros(h * n_split, cp.float32)
    pacc = cp.zeros(h * n_split * d, cp.float32)
    counter = cp.zeros(kvh, cp.int32)
    out = cp.zeros(h * d, cp.float32)
    scale = np.float32(1 / np.sqrt(d))
    null = np.uint64(0)

    def launch(i: int) -> None:
        kc, vc, kd, vd = layers[i]
        fn(
            (kvh, blocks),
            (32 * nw,),
            (
                q,
                kc,
                vc,
                null if kd is None else kd,
                null if vd is None else vd,
                ids,
                pm,
                pl,
                pacc,
                counter,
                out,
                np.int32(n_ctx),
                np.int32(0),
                scale,
                np.int32(0),
                null,
                null,
                null,
            ),
        )

    launch(0)
    err = 0.0
    if not stage:
        got = cp.asnumpy(out).reshape(h, d)
        want = _reference(cp.asnumpy(q), kref, vref, pos, float(scale))
        err = float(np.abs(got - want).max() / np.abs(want).max())
    from bench.decode_profile import _time  # one CUDA graph of the launches, replayed

    stream = cp.cuda.Stream(non_blocking=True)
    us = _time(cp, stream, lambda: [launch(i) for i in range(n_layers)], reps=1) / n_layers
    kv_bytes = sum(x.nbytes for x in layers[0] if x is not None) * (pos + 1) / n_ctx
    return {
        "shape": shape,
        "kv": kv,
        "chunk": chunk,
        "pos": pos,
        "stage": stage,
        "lanes": lanes,
        "warps": nw,
        "cluster": cluster,
        "cluster_min": cluster_min,
        "blocks": blocks,
        "us": round(us, 2),
        "GBps": round(kv_bytes / us / 1e3, 1),
        "rel_err": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="32,64,128")
    ap.add_argument("--pos", default="640,2048,4000")
    ap.add_argument("--kv", default="f16,int8")
    ap.add_argument("--stages", default="0", help="0 full; 3 launch only, 1 + scan, 2 + slice writes (profiling)")
    ap.add_argument("--lanes", default="0", help="lanes a position (0: the kernel's rule)")
    ap.add_argument("--warps", default="0", help="warps a block (0: the kernel's rule)")
    ap.add_argument(
        "--cluster", default="0", help="blocks of a KV head's thread-block cluster (sm_90; 0: split-K slices)"
    )
    ap.add_argument("--cluster-min", default="192", help="positions a cluster block takes before slices are used")
    ap.add_argument("--out", default=None, help="results folder (bench/results: the run is recorded in its index)")
    a = ap.parse_args()
    rows = []
    first_chunk, first_cmin = int(a.chunks.split(",")[0]), int(a.cluster_min.split(",")[0])
    for shape in SHAPES:
        for kv in a.kv.split(","):
            caches = _caches(shape, kv, 4096)
            for pos, chunk, stage, lanes, warps, cluster, cmin in itertools.product(
                map(int, a.pos.split(",")),
                map(int, a.chunks.split(",")),
                map(int, a.stages.split(",")),
                map(int, a.lanes.split(",")),
                map(int, a.warps.split(",")),
                map(int, a.cluster.split(",")),
                map(int, a.cluster_min.split(",")),
            ):
                if (cluster and (stage or chunk != first_chunk)) or (not cluster and cmin != first_cmin):
                    continue  # a cluster's blocks cannot stop early; its slices do not depend on the chunk
                r = run(
                    shape,
                    kv,
                    chunk,
                    pos,
                    caches,
                    stage=stage,
                    lanes=lanes or None,
                    warps=warps or None,
                    cluster=cluster,
                    cluster_min=cmin,
                )
                rows.append(r)
                print(
                    f"{shape:9s} {kv:5s} pos {pos:5d} chunk {chunk:4d} stage {stage} lanes {lanes:2d} warps {r['warps']} "
                    f"cluster {cluster}/{cmin} blocks {r['blocks']}: "
                    f"{r['us']:6.2f} us "
                    f"({r['GBps']:7.1f} GB/s of cache)  rel.err {r['rel_err']:.1e}",
                    flush=True,
                )
                assert r["rel_err"] < 2e-3, r
    if a.out:
        p = Path(a.out) / f"attn_sweep-{time.strftime('%Y%m%d-%H%M%S')}.json"
        p.write_text(json.dumps(rows, indent=1))
        print("wrote", p)
        _record(p, rows)


def _record(path: Path, rows: list[dict]) -> None:
    """The fastest full-kernel f16 launch at the smallest position, per shape, into the results index."""
    full = [r for r in rows if r["stage"] == 0 and r["kv"] == "f16"]
    if not full:
        return
    pos = min(r["pos"] for r in full)
    best = {
        sh: min(r["us"] for r in full if r["shape"] == sh and r["pos"] == pos)
        for sh in dict.fromkeys(r["shape"] for r in full)
    }
    names = {"smollm2": "SmolLM2 shape", "qwen3-4b": "Qwen3-4B shape"}
    record(
        "attn_sweep",
        path,
        {f"{sh}.us_pos{pos}": (us, "us") for sh, us in best.items()},
        reference="a float64 reference (error checked before timing)",
        headline=f"f16 KV, {pos} positions, fastest launch shape: "
        + ", ".join(f"{names.get(sh, sh)} {us:.1f} us" for sh, us in best.items()),
        command="`python -m bench.attn_sweep`",
    )


if __name__ == "__main__":
    main()
