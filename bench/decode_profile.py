"""Per-launch GPU time of the CUDA decode step (engine.backends.cupy_decoder) on generated models.

    python bench/decode_profile.py [--models smollm2,qwen3-4b] [--pos 640]

Times each launch of the captured step on its own (CUDA events, repeated), groups them by kernel,
prints microseconds per token and, for GEMVs, the weight bandwidth; then the whole graph replay.
For the GEMVs of layer 0 and the head, also tries other grid sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import load_model  # noqa: E402
from engine.synth import preset_config, write_config  # noqa: E402

PRESETS = {"smollm2": "smollm2-135m-q4_1", "qwen3-4b": "qwen3-4b-q4_k_m"}


def _time(cp, stream, fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """GPU microseconds per call, `reps` calls captured in one graph (no host launch cost)."""
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


def profile(key: str, path: str, pos: int) -> None:
    import cupy as cp

    m = load_model(path, backend="cupy", n_ctx=4096, kv_dtype="f16")
    dec = m.decoder
    dec.ids_host[:] = (1, pos, 0, 0)
    dec._upload_ids()
    dec.stream.synchronize()
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for ln in dec.plan:
        us = _time(cp, dec.stream, ln)
        g = ln.name.split("[")[0]
        groups[g][0] += us
        groups[g][1] += 1
        if ln.name.startswith("gemv"):
            groups[g][2] += int(ln.args[0].nbytes)
    total = sum(v[0] for v in groups.values())
    print(f"\n== {key}: {len(dec.plan)} launches, sum of single launches {total:.0f} us/token")
    for g, (us, n, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        bw = f"{nbytes / us / 1e3:7.0f} GB/s" if nbytes else ""
        print(f"  {g:14} {n:4d} launches {us:8.1f} us ({us / n:6.2f} each) {bw}")
    if dec.graph is not None:
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(dec.stream)
        for _ in range(50):
            dec.graph.launch(dec.stream)
        b.record(dec.stream)
        b.synchronize()
        us = cp.cuda.get_elapsed_time(a, b) * 1e3 / 50
        print(f"  graph replay: {us:.0f} us/token = {1e6 / us:.0f} tok/s")
    # grid-size variants for layer 0's GEMVs and the head
    seen = set()
    for ln in dec.plan:
        if not ln.name.startswith("gemv") or ln.name in seen:
            continue
        seen.add(ln.name)
        row = []
        t = ln.name.split("_", 1)[1].split("[")[0]
        for r in (1, 2):
            if r == 2 and int(ln.args[10]) >= 2:
                continue  # GLU epilogue: R=1 only
            fn = dec._fn(f"dgemv{'2' if r == 2 else ''}_{t}")
            last = None
            for mult in (2, 4, 8, 10**6):
                rows = int(ln.args[2])
                blocks = max(1, min(-(-rows // (8 * r)), mult * dec.n_sm))
                if blocks == last:
                    continue
                last = blocks
                v = type(ln)(fn, (blocks,), ln.block, ln.args, ln.smem, ln.name)
                row.append((r, blocks, _time(cp, dec.stream, v)))
        nb = int(ln.args[0].nbytes)
        print(f"  {ln.name:24} (plan {ln.fn is dec._fn('dgemv2_' + t) and 2 or 1}x{ln.grid[0]}) "
              + " ".join(f"R{r}x{b}:{u:.1f}us/{nb / u / 1e3:.0f}" for r, b, u in row))
    m.close()


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
