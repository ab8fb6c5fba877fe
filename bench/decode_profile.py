"""Per-launch GPU time of the CUDA decode step (engine.backends.cupy_decoder) on generated models.

    python -m bench.decode_profile [--models smollm2,qwen3-4b] [--pos 640]

Times each launch of the captured step on its own (CUDA events, repeated), groups them by kernel,
prints microseconds per token and, for GEMVs, the weight bandwidth; then the whole graph replay.
For the GEMVs of layer 0 and the head, also tries other grid sizes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import defaultdict

import numpy as np

from engine import load_model
from engine.synth import preset_config, write_config

PRESETS = {"smollm2": "smollm2-135m-q4_1", "qwen3-4b": "qwen3-4b-q4_k_m"}


def _time(cp, stream, fn, reps: int = 20, flush=None) -> float:  # type: ignore[no-untyped-def]
    """GPU microseconds per call, `reps` calls captured in one graph (no host launch cost).
    `flush` (a device buffer larger than L2): each call comes after a write of it, so the weights
    come from DRAM as in a real step; the writes alone are timed the same way and subtracted."""
    if flush is not None:

        def both() -> None:
            flush.fill(0)
            fn()

        return _time(cp, stream, both, reps) - _time(cp, stream, lambda: flush.fill(0), reps)
    with stream:
        fn()
        stream.begin_capture()
        for _ in range(reps):
            fn()
        g = stream.end_capture()
        g.launch(stream)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(3):
            g.launch(stream)
        b.record(stream)
        b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1e3 / reps / 3  # us


def _graph_us(cp, stream, launches, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """GPU microseconds of one replay of `launches` captured as one graph."""
    with stream:
        stream.begin_capture()
        for ln in launches:
            ln()
        g = stream.end_capture()
        g.launch(stream)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        for _ in range(reps):
            g.launch(stream)
        b.record(stream)
        b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) * 1e3 / reps


def profile(key: str, path: str, pos: int) -> None:
    m = load_model(path, backend="cupy", n_ctx=4096, kv_dtype="f16")
    profile_model(m, key, pos)
    m.close()


def profile_model(m, key: str, pos: int, out=print) -> None:  # type: ignore[no-untyped-def]
    """Per-launch times of a loaded model's decode step at position `pos`, then GEMV variants."""
    import cupy as cp

    from engine.backends import cupy_decoder as cd

    dec = m.decoder
    dec.ids_host[:] = (1, pos, 0, 0)
    dec._upload_ids()
    dec.stream.synchronize()
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"])
    flush = cp.zeros(4 * l2 // 4, dtype=cp.float32)  # 4x the L2
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for ln in dec.plan:
        us = _time(cp, dec.stream, ln, flush=flush)
        g = ln.name.split("[")[0]
        groups[g][0] += us
        groups[g][1] += 1
        if "gemv" in ln.name:  # a two-piece launch's second piece is its 6th argument
            groups[g][2] += int(ln.args[0].nbytes) + (int(ln.args[5].nbytes) if g.startswith("qgemv_mix") else 0)
    total = sum(v[0] for v in groups.values())
    out(
        f"\n== {key}: {len(dec.plan)} launches, sum of single launches {total:.0f} us/token "
        f"(each after an L2 flush: weights from DRAM)"
    )
    for g, (us, n, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        bw = f"{nbytes / us / 1e3:7.0f} GB/s" if nbytes else ""
        out(f"  {g:14} {n:4d} launches {us:8.1f} us ({us / n:6.2f} each) {bw}")
    if dec.graph is not None:
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(dec.stream)
        for _ in range(50):
            dec.graph.launch(dec.stream)
        b.record(dec.stream)
        b.synchronize()
        us = cp.cuda.get_elapsed_time(a, b) * 1e3 / 50
        out(f"  graph replay: {us:.0f} us/token = {1e6 / us:.0f} tok/s (PDL {dec.pdl})")
        # what each kernel group costs inside the graph: the step replayed without it
        full = _graph_us(cp, dec.stream, dec.plan)
        for g in sorted(groups, key=lambda g: -groups[g][0]):
            rest = [ln for ln in dec.plan if ln.name.split("[")[0] != g]
            if rest and len(rest) < len(dec.plan):
                out(
                    f"  in the graph: {g:14} {full - _graph_us(cp, dec.stream, rest):8.1f} us "
                    f"(step without it {_graph_us(cp, dec.stream, rest):.0f} us)"
                )
    # integer GEMVs of layer 0 and the head: threads per row x grid cap variants
    seen = set()
    for ln in dec.plan:
        if not ln.name.startswith("qgemv") or ln.name.startswith("qgemv_mix") or ln.name in seen:
            continue  # (a two-piece launch's arguments are laid out otherwise: timed above only)
        seen.add(ln.name)
        rows = int(ln.args[2])
        row = []
        for tpr in (8, 16, 32, 64):
            for cap in (4, 8):
                blocks = max(1, min(-(-rows // (256 // tpr)), cap * dec.n_sm))
                v = cd._Launch(ln.fn, (blocks,), ln.block, ln.args[:-1] + (np.int32(tpr),), ln.smem, ln.name)
                row.append((tpr, blocks, _time(cp, dec.stream, v, flush=flush)))
        nb = int(ln.args[0].nbytes)
        best = min(row, key=lambda r: r[2])
        out(
            f"  {ln.name:26} plan tpr{int(ln.args[-1])}x{ln.grid[0]} {_time(cp, dec.stream, ln, flush=flush):.1f}us; "
            f"best tpr{best[0]}x{best[1]} {best[2]:.1f}us = {nb / best[2] / 1e3:.0f} GB/s; "
            + " ".join(f"{t}x{b}:{u:.1f}" for t, b, u in row)
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,qwen3-4b")
    ap.add_argument("--pos", type=int, default=640)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for key in a.models.split(","):
            path = os.path.join(tmp, key + ".gguf")
            write_config(path, preset_config(PRESETS[key], fast=True))
            profile(key, path, a.pos)
            os.remove(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
