"""The GEMV launches of the decode step (`cupy_step`): y = W @ prep(x), the input normed and
rounded as llama.cpp does, by integer dot products (`qgemv_<T>`, after one `qprep_x`) where W's
type has them and the rounding is on, else by the float kernel (`dgemv_<T>`); and `Launch`, one
kernel launch with its arguments fixed, of which a step is a list.

Kernels: `engine.kernels.decode_src` and `engine.kernels.qdot_src`.
"""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from ..kernels import qdot_src
from .cupy_launch import PdlLaunch

ROWS_PER_BLOCK = 8  # warps per GEMV block, one row each
GEMV_THREADS = 32 * ROWS_PER_BLOCK
GRID_CAP = 4  # GEMV blocks per multiprocessor at most (rows are strided over the grid)
AQ_CODE = {None: 0, "q8_0": 1, "q8_k": 2}


def ptr(a: Any) -> Any:
    """A kernel's pointer argument: the array, or a null pointer for None."""
    return np.uint64(0) if a is None else a


class Launch:
    """One kernel launch with its arguments fixed (device pointers, sizes); `use_pdl` switches it
    to a programmatic dependent launch (`cupy_launch`) on the current stream."""

    __slots__ = ("fn", "grid", "block", "args", "smem", "name", "pdl")

    def __init__(
        self,
        fn: Any,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple[Any, ...],
        smem: int = 0,
        name: str = "",
    ) -> None:
        self.fn, self.grid, self.block, self.args, self.smem, self.name = fn, grid, block, args, smem, name
        self.pdl: PdlLaunch | None = None

    def use_pdl(self, lib: Any) -> None:
        self.pdl = None if lib is None else PdlLaunch(lib, self.fn, self.grid, self.block, self.args, self.smem)

    def __call__(self) -> None:
        if self.pdl is not None:
            self.pdl(cp.cuda.get_current_stream().ptr)
        else:
            self.fn(self.grid, self.block, self.args, shared_mem=self.smem)


USE_QGEMV = True  # integer dot products where the activation rounding is on (False: float path)
USE_MIX = True  # a matrix of two pieces of two types in one launch (False: a launch a piece)


def qgemv_config(type_name: str, rows: int, n_sm: int, cols: int = 0, budget: int = 5) -> tuple[int, int]:
    """(threads per row, grid cap in blocks per SM) of the integer GEMV (`budget`: row groups an SM,
    the kernels' resident blocks: 5).

    Inputs of >= 1536 values (v7, timed with the weights coming from DRAM, each launch after an
    L2 flush: bench/results/decode_profile-*-v7a*/v7b*.txt): the most threads a row (64, 32, 16) that
    keeps the row groups within 5 a multiprocessor, one group a block (cap 8): Qwen3-4B shape
    2560x9728 15.4 -> 11.0 us, 4096x2560 8.1 -> 6.7 us, 2560x4096 7.8 -> 6.7 us, gate/up 19.5 ->
    15.6 us. Smaller inputs (SmolLM2, timed v3b): 16 threads a row from 4096 rows up, else 32;
    the heads (>= 32768 rows) 8 (SmolLM2 head 9.8 vs 12.4 us); Q6_K likes a cap of 8."""
    if cols >= 1536:
        for tpr in (64, 32, 16):
            if rows * tpr <= budget * n_sm * 256:
                return tpr, 8
        return 8, 8
    if rows >= 32768:
        tpr = 8
    elif rows >= 4096:
        tpr = 16
    else:  # few rows of long inputs: more threads a row (v4 profile: 1024x2560 3.2 vs 3.6 us)
        tpr = 64 if rows <= 1024 and cols >= 1536 else 32
    return tpr, (8 if type_name == "Q6_K" else 4)


def qgemv_grid(type_name: str, rows: int, n_sm: int, cols: int, budget: int = 5) -> tuple[int, int]:
    """(threads per row, blocks) of an integer GEMV launch over `rows` rows (`qgemv_config`)."""
    tpr, cap = qgemv_config(type_name, rows, n_sm, cols, budget)
    return tpr, max(1, min(-(-rows // (256 // tpr)), cap * n_sm))


class QInput:
    """A matrix input rounded to int8 blocks (`qprep_x`): values, per-block scales, per-16 sums.
    Sized for the widest input; one serves every GEMV of a step (they run one after another)."""

    def __init__(self, cols: int) -> None:
        self.cols = cols
        self.xq = cp.zeros(cols, dtype=cp.int8)
        self.xd = cp.zeros(max(1, cols // 32), dtype=cp.float32)
        self.xs16 = cp.zeros(max(1, cols // 16), dtype=cp.int32)

    @property
    def nbytes(self) -> int:
        return int(self.xq.nbytes + self.xd.nbytes + self.xs16.nbytes)  # cupy_plan.rounded_input_bytes


def gemv_launches(
    fn: Any,
    n_sm: int,
    w: Any,
    x: cp.ndarray,
    nw: cp.ndarray | None,
    eps: np.float32,
    aq: str | None,
    y: cp.ndarray,
    bias: cp.ndarray | None = None,
    epi: int = 0,
    out_rows: int | None = None,
    qin: QInput | None = None,
    input_ready: bool = False,
    budget: int = 0,
) -> list[Launch]:
    """The launches of y = W @ prep(x) (norm by `nw`, llama.cpp rounding `aq`) with epilogue `epi`:
    where W's type has an integer dot product and the rounding is on, one `qprep_x` launch rounds
    the input into `qin` (allocated here when not given), then the integer-dot kernel
    (`qgemv_<T>`) reads it; other pieces use the float kernel (`dgemv_<T>`, which prepares its
    input itself). `budget`: `qgemv_config`'s (0: 5).
    `fn(name)` gives a compiled kernel of the decode module."""
    out: list[Launch] = []
    cols = w.shape[1]
    code = AQ_CODE[aq]
    prepped = input_ready  # the producer of x already rounded it into `qin`

    def prep() -> QInput:
        """The rounded input (a `qprep_x` launch first unless the producer rounded it)."""
        nonlocal prepped, qin
        if qin is None or qin.cols < cols:
            qin = QInput(cols)
        if not prepped:
            groups = cols // (32 if code == 1 else 256)
            args = (x, ptr(nw), eps, np.int32(code), np.int32(cols), qin.xq, qin.xd, qin.xs16)
            out.append(Launch(fn("qprep_x"), (max(1, -(-groups // 8)),), (256,), args, 0, f"qprep[{cols}]"))
            prepped = True
        return qin

    pieces, rb = w.pieces(), budget or 5
    if mixes(pieces, aq, epi, out_rows):  # two pieces of two types: one launch (qgemv_mix_<A>_<B>)
        (pa, pb), q = pieces, prep()
        (tpr_a, blocks_a), (tpr_b, blocks_b) = (qgemv_grid(p.type_name, p.shape[0], n_sm, cols, rb) for p in pieces)
        mix_args: tuple[Any, ...] = (pa.raw, np.int64(pa.raw.shape[1]), np.int32(pa.shape[0]), np.int32(tpr_a))
        mix_args += (np.int32(blocks_a), pb.raw, np.int64(pb.raw.shape[1]), np.int32(pb.shape[0]), np.int32(tpr_b))
        mix_args += (np.int32(cols), q.xq, q.xd, q.xs16, y, ptr(bias), np.int32(epi))
        kind = f"qgemv_mix_{pa.type_name}_{pb.type_name}"
        name = f"{kind}[{pa.shape[0]}+{pb.shape[0]}x{cols}]"
        out.append(Launch(fn(kind), (blocks_a + blocks_b,), (256,), mix_args, 0, name))
        return out
    r0 = 0
    for p in pieces:
        rows = p.shape[0] if out_rows is None else out_rows
        b = None if bias is None else bias[r0 : r0 + rows]
        if USE_QGEMV and qdot_src.QTYPES.get(p.type_name) == code:
            qin = prep()
            glu = epi >= 2
            tpr, blocks = qgemv_grid(p.type_name, rows, n_sm, cols, rb)
            name = f"qgemv_{p.type_name}[{rows}x{cols}]"
            tail = (y[r0:], ptr(b), np.int32(epi), np.int32(out_rows or 0), np.int32(tpr))
            k = fn(f"qgemv{'_glu' if glu else ''}_{p.type_name}")
            args = (p.raw, np.int64(p.raw.shape[1]), np.int32(rows), np.int32(cols), qin.xq, qin.xd, qin.xs16, *tail)
            out.append(Launch(k, (blocks,), (256,), args, 0, name))
        else:
            args = (
                p.raw,
                np.int64(p.raw.shape[1]),
                np.int32(rows),
                np.int32(cols),
                x,
                ptr(nw),
                eps,
                np.int32(code),
                y[r0:],
                ptr(b),
                np.int32(epi),
                np.int32(out_rows or 0),
            )
            # two rows a warp where that still fills the GPU (more loads in flight per lane)
            r = 2 if epi < 2 and -(-rows // (2 * ROWS_PER_BLOCK)) >= n_sm else 1
            k = fn(f"dgemv{'2' if r == 2 else ''}_{p.type_name}")
            smem = cols * 4
            if smem > 48 * 1024:
                k.max_dynamic_shared_size_bytes = smem
            blocks = max(1, min(-(-rows // (r * ROWS_PER_BLOCK)), GRID_CAP * n_sm))
            out.append(Launch(k, (blocks,), (GEMV_THREADS,), args, smem, f"gemv_{p.type_name}[{rows}x{cols}]"))
        r0 += rows
    return out


def mixes(pieces: list[Any], aq: str | None, epi: int, out_rows: int | None = None) -> bool:
    """Whether a matrix of these pieces runs as one `qgemv_mix_<A>_<B>` launch: two pieces of two
    types that both round the input as `aq` asks (`qdot_src.mix_pairs`), a plain or adding
    epilogue. The v Q6_K rows of a Q4_K_M QKV: 3 -> 1 launch (with `concat_rows`' runs)."""
    code = AQ_CODE[aq]
    types = tuple(p.type_name for p in pieces)
    return bool(
        USE_QGEMV
        and USE_MIX
        and code
        and epi < 2
        and out_rows is None
        and len(types) == 2
        and types in qdot_src.mix_pairs(types)  # the kernels the module has
        and qdot_src.QTYPES[types[0]] == code
    )


def rounds_input(w: Any, aq: str | None, group: int) -> int:
    """The rounding code (1 q8_0, 2 q8_k) a producer writing `group` consecutive values per
    block may apply for W's integer GEMV, or 0 where W takes the float path or the groups
    would straddle two producers."""
    code = AQ_CODE[aq]
    pieces = w.pieces()
    if not (USE_QGEMV and code and len(pieces) == 1 and qdot_src.QTYPES.get(pieces[0].type_name) == code):
        return 0
    return code if group % (32 if code == 1 else 256) == 0 else 0
