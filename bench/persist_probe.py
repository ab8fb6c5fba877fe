"""Does a persistent kernel pay for the decode step's GEMVs? A probe for issue 19's persistent decoder.

    python -m bench.persist_probe [--preset qwen3-4b-q4_k_m] [--pos 640] [--bounds 4,5]

Loads a generated K-quant model (Q4_K / Q6_K GEMVs) on the CuPy backend and takes the integer GEMV
launches of its decode step (`CupyDecoder.plan`: QKV, output projection, gate+up with the GLU,
down, the head; the step's own grids and threads a row). On the same weights and the same rounded
input it times:

- **graph**: those launches replayed as one CUDA graph with programmatic dependent launch, as the
  step runs them (and with plain launches, for context);
- **each GEMV shape alone**, its weights coming from DRAM (after a write of 4x the L2) and from L2
  (the same launch replayed): whether the GEMVs wait on DRAM;
- **persistent**: one kernel (`persist_gemvs`, launch bounds (256, `--bounds`)) whose blocks, as
  many as fit the GPU at once, run the same GEMV bodies (`qdot_src`'s `qgemv_body_<T>` with a block
  number and count of their own) one after another, separated by a grid barrier (an atomic counter
  each block adds to, then spins on with acquire loads) instead of a kernel boundary; a job's
  descriptor is loaded before the barrier that precedes it; and the same kernel without barriers
  (wrong results: the floor of the design).

Before timing, graph and persistent kernel are run once from the same buffers and must write
bit-identical outputs (each row is one block's, the same sums in the same order). The rest of the
step (rounding, attention, `qkv_post`) is outside this probe; the whole step's replay is printed
beside it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import numpy as np

from engine import load_model
from engine.synth import preset_config, write_config

PERSIST = r"""
__device__ __forceinline__ unsigned int ld_acquire(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
// Every block arrives (after its writes are made visible), then waits until all have; a block
// that waits too long (blocks not all resident: the grid is too large) flags `bad`, and from then
// on no block waits (the run is invalid, but it ends).
__device__ __forceinline__ void grid_sync(unsigned int* bar, unsigned int target, int* bad) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(bar, 1u);
        unsigned int spins = 0;
        while (ld_acquire(bar) < target) {
            if (++spins > (1u << 20) || *(volatile int*)bad) { atomicExch(bad, 1); break; }
        }
    }
    __syncthreads();
}
struct PJob { long long W, row_bytes, y; int rows, cols, tpr, kind, epi, up_off, sync, pad; };
extern "C" __global__ void __launch_bounds__(256, PBLK) persist_gemvs(
        const PJob* __restrict__ jobs, int njobs, const signed char* __restrict__ xq,
        const float* __restrict__ xd, const int* __restrict__ xs16, unsigned int* bar, int* bad) {
    unsigned int nb = gridDim.x, k = 0;
    PJob nx = jobs[0];
    for (int j = 0; j < njobs; j++) {
        PJob jb = nx;
        if (j + 1 < njobs) nx = jobs[j + 1];  // the next descriptor, loaded while this job runs
        const unsigned char* W = (const unsigned char*)jb.W;
        float* y = (float*)jb.y;
        if (jb.kind == 0)
            qgemv_body_Q4_K2<1, QU_Q4_K2(QGEMV_U), true>(W, jb.row_bytes, jb.rows, jb.cols, xq, xd, xs16, y,
                                                        nullptr, jb.epi, 0, jb.tpr, blockIdx.x, nb);
        else if (jb.kind == 1)
            qgemv_body_Q6_K2<1, QU_Q6_K2(QGEMV_U), true>(W, jb.row_bytes, jb.rows, jb.cols, xq, xd, xs16, y,
                                                        nullptr, jb.epi, 0, jb.tpr, blockIdx.x, nb);
        else if (jb.kind == 2)
            qgemv_body_Q4_K<2, QU_Q4_K(QGEMV_UG), true>(W, jb.row_bytes, jb.rows, jb.cols, xq, xd, xs16, y,
                                                       nullptr, jb.epi, jb.up_off, jb.tpr, blockIdx.x, nb);
        else
            qgemv_body_Q6_K<2, QU_Q6_K(QGEMV_UG), true>(W, jb.row_bytes, jb.rows, jb.cols, xq, xd, xs16, y,
                                                       nullptr, jb.epi, jb.up_off, jb.tpr, blockIdx.x, nb);
        if (jb.sync) { k++; grid_sync(bar, k * nb, bad); }
    }
}
"""
KINDS = {("Q4_K", False): 0, ("Q6_K", False): 1, ("Q4_K", True): 2, ("Q6_K", True): 3}


def addr(a: Any) -> int:
    """A launch argument's device address (a CuPy array, or a null pointer)."""
    return int(a.data.ptr) if hasattr(a, "data") else int(a)


def jobs_of(plan: list[Any]) -> tuple[np.ndarray, list[Any]]:
    """The persistent kernel's job table (int64 [jobs, 7]: W, row bytes, y, then int pairs) for
    the integer GEMVs of a step's plan, and those launches."""
    rows: list[list[int]] = []
    gemvs = [ln for ln in plan if ln.name.startswith("qgemv")]

    def job(
        t: str, glu: bool, w: Any, rb: Any, y: int, n: int, cols: int, tpr: int, epi: int, up: int, sync: int
    ) -> None:
        ints = (int(n), int(cols), int(tpr), KINDS[(t, glu)], int(epi), int(up), int(sync), 0)
        rows.append([addr(w), int(rb), y] + [ints[i] | (ints[i + 1] << 32) for i in range(0, 8, 2)])

    for ln in gemvs:
        kind = ln.name.split("[")[0]
        a = ln.args
        if kind.startswith("qgemv_mix_"):
            ta, tb = kind.removeprefix("qgemv_mix_")[:4], kind.removeprefix("qgemv_mix_")[5:]
            wa, rba, ra, tpra, _, wb, rbb, rb_, tprb, cols, _, _, _, y, _, epi = a
            job(ta, False, wa, rba, addr(y), ra, cols, tpra, epi, 0, 0)
            job(tb, False, wb, rbb, addr(y) + 4 * int(ra), rb_, cols, tprb, epi, 0, 1)
        else:
            w, rb, n, cols, _, _, _, y, _, epi, up, tpr = a
            job(kind.removeprefix("qgemv_"), int(epi) >= 2, w, rb, addr(y), n, cols, tpr, epi, up, 1)
    return np.array(rows, dtype=np.int64), gemvs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-4b-q4_k_m")
    ap.add_argument("--pos", type=int, default=640)
    ap.add_argument(
        "--blocks-per-sm", default="", help="persistent grids to try (blocks an SM, comma list); default: what fits"
    )
    ap.add_argument(
        "--bounds", default="4,5", help="the persistent kernel's minimum blocks an SM (launch bounds) to try"
    )
    a = ap.parse_args(argv)
    import cupy as cp

    from bench.decode_profile import _graph_us, _time
    from engine.backends import cupy_decoder as cd
    from engine.backends.cupy_launch import pdl_launcher

    sources: list[str] = []
    compile_module = cd._module

    def capture(src: str) -> Any:
        """The decoder's module, its source kept (the persistent kernel is compiled after it)."""
        sources.append(src)
        return compile_module(src)

    cd._module = capture  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.gguf")
        write_config(path, preset_config(a.preset, fast=True))
        m = load_model(path, backend="cupy", n_ctx=4096)
    cd._module = compile_module
    dec = m.decoder
    dec.ids_host[:] = (0, a.pos, 0, 0)  # the whole step's attention at --pos positions
    dec._upload_ids()
    table, gemvs = jobs_of(dec.plan)
    n_sm = dec.n_sm
    jobs = cp.asarray(table)
    bar = cp.zeros(1, cp.uint32)
    bad = cp.zeros(1, cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    wbytes = sum(int(ln.args[0].nbytes) + (int(ln.args[5].nbytes) if "mix" in ln.name else 0) for ln in gemvs)
    print(f"{a.preset}: {len(gemvs)} GEMV launches, {len(table)} jobs, {wbytes / 1e6:.0f} MB of weights, {n_sm} SMs")
    buffers = [v for v in vars(dec).values() if isinstance(v, cp.ndarray)]
    saved = [b.copy() for b in buffers]

    def restore() -> None:
        for b, s in zip(buffers, saved, strict=True):
            b[...] = s

    graph_us = _graph_us(cp, stream, gemvs)
    lib = pdl_launcher()
    for ln in gemvs:
        ln.use_pdl(None)
    plain_us = _graph_us(cp, stream, gemvs)
    # each GEMV shape alone (plain launches): weights from DRAM (after a write of 4x the L2) or from L2
    l2 = int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"])
    flush = cp.zeros(l2, dtype=cp.float32)
    print("| GEMV (first of each shape) | MB | from DRAM, us | from L2, us | DRAM / L2 |")
    print("|---|---:|---:|---:|---:|")
    for ln in {g.name: g for g in reversed(gemvs)}.values():
        mb = (int(ln.args[0].nbytes) + (int(ln.args[5].nbytes) if "mix" in ln.name else 0)) / 1e6
        cold, warm = _time(cp, stream, ln, flush=flush), _time(cp, stream, ln)
        print(f"| {ln.name} | {mb:.1f} | {cold:.1f} | {warm:.1f} | {cold / warm:.2f} |")
    for ln in gemvs:
        ln.use_pdl(lib)
    step_us = _graph_us(cp, stream, dec.plan)
    print(f"whole decode step (graph replay): {step_us:.0f} us")
    print(
        f"GEMVs as graph launches (PDL): {graph_us:.0f} us ({wbytes / graph_us / 1e6:.2f} TB/s); plain launches {plain_us:.0f} us"
    )
    for bound in [int(x) for x in a.bounds.split(",") if x]:
        mod = cp.RawModule(code=sources[-1] + PERSIST.replace("PBLK", str(bound)), options=("--std=c++17",))
        fn = mod.get_function("persist_gemvs")
        regs = int(fn.num_regs)
        fits = min(8, 65536 // (-(-regs * 32 // 256) * 256 * 8))

        def persist(blocks: int, fn: Any = fn) -> None:
            bar.fill(0)
            fn((blocks,), (256,), (jobs, np.int32(len(table)), dec.qin.xq, dec.qin.xd, dec.qin.xs16, bar, bad))

        jobs[...] = cp.asarray(table)
        with stream:  # the same outputs both ways (run once from the same buffers)
            restore()
            for ln in gemvs:
                ln()
            stream.synchronize()
            want = [b.copy() for b in buffers]
            restore()
            persist(fits * n_sm)
            stream.synchronize()
            got = [b.copy() for b in buffers]
            restore()
        same = all(bool(cp.array_equal(x, y)) for x, y in zip(want, got, strict=True))
        print(
            f"persistent kernel, launch bounds (256, {bound}): {regs} registers a thread, {fits} blocks fit an SM; "
            f"outputs bit-identical: {same}; barrier timed out: {bool(bad.get()[0])}"
        )
        tries = [int(x) for x in a.blocks_per_sm.split(",") if x] or list(range(1, fits + 1))
        for k in [k for k in tries if k <= fits]:
            bad.fill(0)
            us = _graph_us(cp, stream, [lambda k=k: persist(k * n_sm)])
            ok = not bool(bad.get()[0])
            print(
                f"  {k} blocks an SM: {us:.0f} us ({wbytes / us / 1e6:.2f} TB/s), {graph_us / us:.3f}x the graph"
                f"{'' if ok else ' (BARRIER TIMED OUT: not valid)'}"
            )
        free = table.copy()  # the floor of this design: no barrier at all (not a valid step)
        free[:, 6] = 0
        jobs[...] = cp.asarray(free)
        us = _graph_us(cp, stream, [lambda blocks=fits * n_sm: persist(blocks)])
        print(f"  without barriers ({fits} blocks an SM; wrong results, the floor): {us:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
