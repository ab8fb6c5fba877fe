"""CuPy backend: the ops of the forward pass on a CUDA GPU, weights kept quantized on the device.

Weights stay in their GGUF block layout in GPU memory (`QWeight`). One token (decode) runs fused
dequantize+GEMV kernels (one warp per row); several tokens (prefill) multiply fp16-precision
matrices with `mmq_h_<T>` (the GGUF blocks decoded inside the GEMM) for chunks of at most
`cupy_mmq_tokens` tokens; otherwise they dequantize row tiles into one preallocated tile buffer -
fp16 (tensor cores) for large matrices, fp32 for small ones and for stored F32/BF16
(`prefill_dtype="auto"`, the default; or "float16" / "float32" everywhere) - and multiply them
with one cuBLAS GemmEx per tile, fp32 accumulation, written straight into the output (`cupy_blas`).
Prefill attention runs strided-batched GEMMs in blocks of query rows whose scores fit a fixed
buffer (`cupy_attention`). What all this allocates is planned before load:
`cupy_plan`. Kernels: `engine.kernels`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, TypeVar

import cupy as cp
import numpy as np

from .. import kernels
from ..gguf_file import TensorInfo
from ..kernels.mmq_src import I8_TYPES, MMQ_BM, mmq_splits, mmq_tile
from ..kv_cache import QBLOCK, Int8Rows, kv_write
from ..options import DEFAULT_OPTIONS, EngineOptions
from ..quants import dequantize, dequantize_rows
from .cupy_attention import AttnBuffers, decode_attention, prefill_attention
from .cupy_blas import CUDA_R_16F, CUDA_R_32F, OP_N, OP_T, gemm
from .cupy_plan import PREFILL_CHUNK, SCRATCH_ELEMS, mmq_device, resolve_prefill_dtype, tile_dtype, tile_rows
from .cupy_upload import Uploader
from .ops import Ops

log = logging.getLogger(__name__)

_GELU_C = math.sqrt(2.0 / math.pi)
WARPS = 4  # rows per GEMV block

_silu = cp.ElementwiseKernel("float32 g, float32 u", "float32 y", "y = g / (1.0f + expf(-g)) * u", "genie_silu")
_gelu = cp.ElementwiseKernel(
    "float32 g, float32 u, float32 c",
    "float32 y",
    "y = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * u",
    "genie_gelu_tanh",
)


@dataclass
class QWeight:
    """A 2-D weight on the device in its stored layout (or several such, stacked by rows)."""

    raw: cp.ndarray | None
    """uint8 [rows, bytes_per_row] (float types too, as bytes); None when `parts` holds it."""
    type_name: str
    shape: tuple[int, int]
    """(rows, cols) as in y = W @ x."""
    parts: list[QWeight] = field(default_factory=list)
    """Row blocks of different types (a fused QKV whose parts disagree); empty otherwise."""

    @property
    def nbytes(self) -> int:
        if self.parts:
            return sum(p.nbytes for p in self.parts)
        return int(self.raw.nbytes) if self.raw is not None else 0

    def pieces(self) -> list[QWeight]:
        return self.parts or [self]


def _null() -> np.uint64:
    return np.uint64(0)


_T = TypeVar("_T", QWeight, TensorInfo)


def _type_runs(items: list[_T]) -> list[list[_T]]:
    """`items` cut into runs of consecutive items of one `type_name` (each run becomes one buffer)."""
    return [list(run) for _, run in groupby(items, key=lambda x: x.type_name)]


def _rows_of(t: TensorInfo) -> tuple[np.ndarray, tuple[str, int, tuple[int, int, int, int]] | None]:
    """A 2-D tensor's bytes as [rows, bytes a row] and where they lie in the file (None: read from
    the array): the uploader reads them from the file while it is the one mapped, faster than the
    mapping's copy."""
    source = None
    if isinstance(t.raw, np.memmap) and t.raw.filename and t.raw.flags.c_contiguous and t.file_identity:
        source = (str(t.raw.filename), t.offset, t.file_identity)
    return np.ascontiguousarray(t.raw).view(np.uint8).reshape(t.shape[0], -1), source


class CupyOps:
    """The ops of `engine.model.Transformer` on CUDA (same interface as NumpyOps)."""

    name = "cupy"
    xp = cp
    batch_dependent = False
    """Every row's result is independent of the batch (see `Ops.batch_dependent`)."""

    prefill_chunk = PREFILL_CHUNK
    """Prompt tokens per forward pass that `Model.generate` uses by default (512: a chunk's GEMMs
    fill the GPU; the gate is still awaited between two chunks)."""

    def __init__(self, prefill_dtype: str | None = None, options: EngineOptions | None = None) -> None:
        kernels.module()  # compile now (NVRTC), not in the middle of the first forward pass
        self.options = options or DEFAULT_OPTIONS
        """The tuning knobs (`EngineOptions`; None: the defaults); `make_decoder` passes them on."""
        if self.options.prefill_chunk:
            self.prefill_chunk = int(self.options.prefill_chunk)  # the caller's chunk (memory plan, graphs)
        self.decoder_mode = self.options.cupy_decoder
        """One-token steps: "graph" (fused kernels replayed from a CUDA graph), "eager" (the same
        kernels launched one by one) or "off" (the generic forward pass)."""
        self.prefill_dtype = resolve_prefill_dtype(prefill_dtype, self.options.cupy_prefill)
        """Prefill tile precision: "auto" (fp16 tiles for matrices of >= 4M values except stored
        F32/BF16, fp32 otherwise; `cupy_plan.tile_dtype`), "float16" or "float32" (exact to
        ~1e-6, what the whole-model tests pin); None: the options' `cupy_prefill`."""
        self._scratch: cp.ndarray | None = None  # tile buffer (uint8), see _tiles
        self._max_elems = 0  # values of the largest fused matrix (QKV, gate+up): sizes the tiles
        self._attn: AttnBuffers | None = None
        self._gemm_ok: dict[bool, bool] = {}  # per fp16/fp32: GemmEx checked against cp.matmul
        self._prefilled = False  # an eager multi-token product ran (prefill_warm)
        self.attn_tf32 = False
        """Prefill attention's GEMMs round to TF32 (set per model: where its matrices multiply in
        fp16 precision, `make_decoder`); False: fp32, as the "float32" precision promises."""
        self.prefill_graphs: Any = None  # prefill graphs (cupy_prefill_graph), set per model
        self.mmq = self.options.cupy_mmq and mmq_device()
        """fp16-precision matrices multiply with `mmq_h_<T>` / `mmq_w_<T>` (no tiles); False: tiles + cuBLAS."""
        self.mmq_tokens = int(self.options.cupy_mmq_tokens)
        """The longest chunk `mmq_h_<T>` multiplies; longer ones go through fp16 tiles + cuBLAS."""
        self.mmq_i8 = self.mmq and self.options.cupy_mmq_i8
        """Q4_K pieces of fp16-precision matrices multiply in int8 (`mmq_i8_<T>`) where the chunk rounds to q8_k."""
        self.mmq_split = self.options.cupy_mmq_split
        """Short chunks split the GEMMs' K over blocks (`mmq_splits`)."""
        self.sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
        """The GPU's multiprocessors (`mmq_tile` sizes the GEMMs' tiles by them)."""
        if self.mmq:
            kernels.mmq_module()  # compiled with the rest, before the first prefill
        self._uploader: Uploader | None = None  # weight transfers in flight (`weight`)
        # A load starts from an emptied pool: what an unloaded model left cached there goes back to
        # CUDA (the plan counts no leftovers; the stacked uploads free no pieces that would do it).
        cp.get_default_memory_pool().free_all_blocks()

    # --- weights -------------------------------------------------------------------------
    def weight(self, t: TensorInfo) -> QWeight | cp.ndarray:
        """2-D: raw bytes on the device (QWeight); 1-D (norms, biases): float32 array."""
        if len(t.shape) != 2:
            return self._uploads().upload(dequantize(t.raw, t.type_name, t.shape))
        raw, source = _rows_of(t)
        dev = self._uploads().upload(raw, source, defer=True)
        return QWeight(dev, t.type_name, (int(t.shape[0]), int(t.shape[1])))

    def weight_rows(self, ts: list[TensorInfo]) -> QWeight:
        """`concat_rows([weight(t) for t in ts])` without the pieces' own buffers: each run of one
        type is one buffer, allocated once, and its tensors are uploaded straight into their rows
        (no concatenation, no freed pieces left in the pool)."""
        up = self._uploads()
        pieces = []
        for run in _type_runs(ts):
            rows = [_rows_of(t) for t in run]
            buf = cp.empty((sum(r.shape[0] for r, _ in rows), rows[0][0].shape[1]), dtype=np.uint8)
            r0 = 0
            for raw, source in rows:
                up.upload(raw, source, out=buf[r0 : r0 + raw.shape[0]], defer=True)
                r0 += raw.shape[0]
            pieces.append(QWeight(buf, run[0].type_name, (int(buf.shape[0]), int(run[0].shape[1]))))
        n_rows = sum(int(t.shape[0]) for t in ts)
        out = pieces[0] if len(pieces) == 1 else QWeight(None, "mixed", (n_rows, int(ts[0].shape[1])), pieces)
        return self._sized(out)

    def _uploads(self) -> Uploader:
        """The load's uploader (made at its first weight: the transfers overlap; `finish_uploads` ends them)."""
        if self._uploader is None:
            self._uploader = Uploader()
        return self._uploader

    def _sized(self, w: QWeight) -> QWeight:
        """`w`, a fused matrix the tile buffer is sized for where it may prefill through tiles."""
        if not self.uses_mmq(w, self.prefill_chunk):
            self._max_elems = max(self._max_elems, w.shape[0] * w.shape[1])
        return w

    def finish_uploads(self) -> None:
        """Read the weights deferred from their file, wait for every transfer and free the staging
        buffers (the model's load calls it after its weights; `make_decoder` and the products that
        read a weight - linear, matmul, gemv, the mmq kernels, dequantize, embed_rows, concat_rows -
        call it first when uploads are pending)."""
        if self._uploader is not None:
            self._uploader.finish()
            self._uploader = None

    def _settle(self) -> None:
        """`finish_uploads` if a weight is still waiting for its bytes (a load ends with it)."""
        if self._uploader is not None and self._uploader.deferred:
            self.finish_uploads()

    def concat_rows(self, parts: list[QWeight]) -> QWeight:
        """Stack weights by rows: one buffer when the types agree, else a list of pieces in which
        runs of one type are one buffer (Q and K of a Q4_K_M QKV: one launch, more blocks)."""
        self._settle()
        cols = parts[0].shape[1]
        rows = sum(p.shape[0] for p in parts)
        if len({p.type_name for p in parts}) == 1 and all(not p.parts for p in parts):
            out = self._stack(parts)
        else:
            runs = _type_runs([q for p in parts for q in p.pieces()])
            out = QWeight(None, "mixed", (rows, cols), [r[0] if len(r) == 1 else self._stack(r) for r in runs])
        return self._sized(out)

    @staticmethod
    def _stack(parts: list[QWeight]) -> QWeight:
        """Pieces of one type as one buffer (their own buffers freed)."""
        raw = cp.concatenate([p.raw for p in parts], axis=0)
        for p in parts:
            p.raw = None  # free the pieces...
        # ...and give them back to CUDA now: cached, they would be split by the next small
        # allocations and stay in the pool as fragments (the plan counts no load leftovers)
        cp.get_default_memory_pool().free_all_blocks()
        return QWeight(raw, parts[0].type_name, (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def embed_rows(self, table: QWeight | TensorInfo, ids: np.ndarray, cols: int) -> cp.ndarray:
        """Rows of the embedding table [T] -> [T, E]; a host-side table is decoded on the host."""
        self._settle()
        if isinstance(table, TensorInfo):
            return cp.asarray(dequantize_rows(table.raw, table.type_name, ids, cols))
        w = table.pieces()[0] if len(table.pieces()) == 1 else None
        if w is None:
            raise ValueError("embedding table made of mixed pieces")
        n = len(ids)
        out = cp.empty((n, cols), dtype=cp.float32)
        dev_ids = ids if isinstance(ids, cp.ndarray) else cp.asarray(np.asarray(ids, dtype=np.int64))
        units = n * (cols // 32)
        assert w.raw is not None  # a single piece holds its bytes
        kernels.kernel(f"gather_{w.type_name}")(
            ((units + 127) // 128,),
            (128,),
            (w.raw, np.int64(w.raw.shape[1]), dev_ids, out, np.int32(n), np.int32(cols)),
        )
        return out

    def zeros(self, shape: tuple[int, ...], dtype: str) -> cp.ndarray:
        return cp.zeros(shape, dtype=np.dtype(dtype))

    def to_host(self, x: cp.ndarray) -> np.ndarray:
        return cp.asnumpy(x)

    @staticmethod
    def synchronize() -> None:
        """Wait until the calling thread's stream has finished its work (a prefill piece ends
        with this, so a generation parked between two pieces leaves nothing queued)."""
        cp.cuda.get_current_stream().synchronize()

    @staticmethod
    def mark() -> cp.cuda.Event:
        """An event recorded now on the calling thread's stream: its `synchronize()` returns once
        the work queued before it has finished (a prefill piece kept queued ahead, `Pass.queued`)."""
        ev = cp.cuda.Event(disable_timing=True)
        ev.record()
        return ev

    # --- matrices ------------------------------------------------------------------------
    @staticmethod
    def act_quant(x: cp.ndarray, kind: str | None, half: bool = False) -> cp.ndarray:
        """llama.cpp's activation rounding on the device (NumpyOps.act_quant's twin); `half`: the
        result as float16 (what `astype(float16)` of it gives, rounded and converted in one launch)."""
        if kind is None:
            return cp.ascontiguousarray(x.astype(cp.float16)) if half else x
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        y = cp.empty(x.shape, dtype=cp.float16 if half else cp.float32)
        groups = x.size // (32 if kind == "q8_0" else 256)
        per_block = 8
        name = ("act_q8_0" if kind == "q8_0" else "act_q8_k") + ("_h" if half else "")
        kernels.kernel(name)(((groups + per_block - 1) // per_block,), (32 * per_block,), (x, y, np.int32(groups)))
        return y

    def gemv(self, w: QWeight, x: cp.ndarray, y: cp.ndarray, bias: cp.ndarray | None) -> None:
        """y[rows] = W @ x (+ bias) with the fused dequantize+GEMV kernel of W's type."""
        self._settle()
        r0 = 0
        for p in w.pieces():
            rows, cols = p.shape
            b = _null() if bias is None else bias[r0 : r0 + rows]
            assert p.raw is not None  # pieces() yields weights that hold their bytes
            kernels.kernel(f"gemv_{p.type_name}")(
                ((rows + WARPS - 1) // WARPS,),
                (32 * WARPS,),
                (p.raw, np.int64(p.raw.shape[1]), x, y[r0 : r0 + rows], b, np.int32(rows), np.int32(cols)),
            )
            r0 += rows

    def dequant_f16(self, p: QWeight, r0: int, r1: int, out: cp.ndarray) -> None:
        """Rows r0..r1 of one piece as fp16 into `out` [r1 - r0, cols]."""
        self._settle()
        self._dequant("dequant_h", p, r0, r1, out)

    def dequant_f32(self, p: QWeight, r0: int, r1: int, out: cp.ndarray) -> None:
        """Rows r0..r1 of one piece as fp32 into `out` [r1 - r0, cols]."""
        self._settle()
        self._dequant("dequant_f", p, r0, r1, out)

    @staticmethod
    def _dequant(kernel: str, p: QWeight, r0: int, r1: int, out: cp.ndarray) -> None:
        """Launch `<kernel>_<type>` over rows r0..r1 of `p` (one thread per 32-value unit)."""
        cols = p.shape[1]
        units = (r1 - r0) * (cols // 32)
        assert p.raw is not None  # a piece holds its bytes
        kernels.kernel(f"{kernel}_{p.type_name}")(
            ((units + 127) // 128,),
            (128,),
            (p.raw[r0:r1], np.int64(p.raw.shape[1]), out, np.int32(r1 - r0), np.int32(cols)),
        )

    def _gemm(self, wt: cp.ndarray, xs: cp.ndarray, y: cp.ndarray, col0: int) -> None:
        """y[:, col0 : col0 + m] = xs @ wt.T by one cuBLAS GemmEx (fp32 compute and output),
        written in place: no temporary, no copy. wt [m, k] and xs [t, k] fp16 or fp32, C-order."""
        m, k = wt.shape
        t = xs.shape[0]
        dt = CUDA_R_16F if wt.dtype == cp.float16 else CUDA_R_32F
        # column-major view: C[m, t] (ldc = y's row length) = op(A = wt as [k, m])^T [m, k] x B [k, t]
        gemm(OP_T, OP_N, m, t, k, wt.data.ptr, k, xs.data.ptr, k, y.data.ptr + col0 * 4, y.shape[1], in_type=dt)

    def tile_dtype(self, w: QWeight) -> str:
        """The tile precision of `w` ("float16" or "float32") under `prefill_dtype`."""
        return tile_dtype(self.prefill_dtype, {p.type_name for p in w.pieces()}, *w.shape)

    def _tiles(self, itemsize: int, elems: int) -> cp.ndarray:
        """The tile buffer (uint8): min(SCRATCH_ELEMS, largest layer matrix) values of the widest
        tile element used so far. Allocated at the first prefill, after load, at the size of the
        largest fused matrix (QKV or gate+up: the largest of a layer); grown when a larger one is
        multiplied (the head, for several rows of logits) or fp16 -> fp32 tiles, as the plan counts."""
        need = min(SCRATCH_ELEMS, max(self._max_elems, elems)) * itemsize
        if self._scratch is None or self._scratch.nbytes < need:
            self._scratch = None  # give the smaller buffer back first
            self._scratch = cp.empty(need, dtype=cp.uint8)
        return self._scratch

    def prefill_warm(self) -> bool:
        """Whether an eager prefill ran: the buffers and checks it makes on first use (tile and
        attention buffers, the GemmEx check) exist, so a graph capture need not make them."""
        return self._prefilled and self._attn is not None

    def prefill_state(self) -> tuple[Any, Any, dict[bool, bool]]:
        """What an eager prefill makes on first use (`prefill_warm`), to check that a graph
        capture left it unchanged (`prefill_state_same`) or to put it back (`drop_prefill_state`)."""
        return self._scratch, self._attn, dict(self._gemm_ok)

    def prefill_state_same(self, before: tuple[Any, Any, dict[bool, bool]]) -> bool:
        """Whether `prefill_state()` is still `before` (the same buffers, the same checks)."""
        return self._scratch is before[0] and self._attn is before[1] and self._gemm_ok == before[2]

    def drop_prefill_state(self, before: tuple[Any, Any, dict[bool, bool]]) -> None:
        """Put `prefill_state` back to `before` (a buffer a failed capture made came from its pool)."""
        self._scratch, self._attn = before[0], before[1]
        self._gemm_ok = dict(before[2])

    def uses_mmq(self, w: QWeight, t: int) -> bool:
        """Whether `matmul` multiplies `w` by a chunk of `t` tokens with `mmq_h_<T>` / `mmq_w_<T>`
        (fp16 precision, sm_80+, option on, `t` <= `mmq_tokens`); else tiles + cuBLAS."""
        return self.mmq and t <= self.mmq_tokens and self.tile_dtype(w) == "float16"

    def _mmq(
        self, p: QWeight, xs: cp.ndarray, y: cp.ndarray, col0: int, bn: int | None = None, splits: int | None = None
    ) -> None:
        """y[:, col0 : col0 + rows] = xs @ W.T for one piece, its GGUF blocks decoded in the GEMM:
        `mmq_w_<T>` (128-token tiles) or `mmq_h_<T>` (64), as `bn` says or `mmq_tile` picks; K
        split over `splits` blocks (`mmq_splits` picks) whose slices `mmq_sum` adds up."""
        rows, cols = p.shape
        t = xs.shape[0]
        if bn is None:
            bn = mmq_tile(t, rows, self.sms)
        self._mmq_launch(f"mmq_{'w' if bn == 128 else 'h'}_{p.type_name}", p, (xs,), y, col0, t, bn, splits)

    def _mmq_launch(
        self,
        name: str,
        p: QWeight,
        xs: tuple[cp.ndarray, ...],
        y: cp.ndarray,
        col0: int,
        t: int,
        bn: int,
        splits: int | None,
    ) -> None:
        """Launch the mmq kernel `name` (`bn`-token tiles) of one piece on the chunk's arrays `xs`
        into y[:, col0 : col0 + rows]; K split over `splits` blocks (None: `mmq_splits` picks)
        whose slices `mmq_sum` adds up."""
        self._settle()
        rows, cols = p.shape
        assert p.raw is not None  # a piece holds its bytes
        if splits is None:
            splits = mmq_splits(t, rows, cols, self.sms, bn) if self.mmq_split else 1
        part = cp.empty((splits, t, rows), dtype=cp.float32) if splits > 1 else None
        out = np.uint64(y.data.ptr + col0 * 4)
        kernels.mmq_kernel(name)(
            (-(-t // bn), -(-rows // MMQ_BM), splits),
            (256,),
            (
                p.raw,
                np.int64(p.raw.shape[1]),
                *xs,
                out,
                np.int32(y.shape[1]),
                np.int32(rows),
                np.int32(cols),
                np.int32(t),
                np.uint64(0 if part is None else part.data.ptr),
            ),
        )
        if part is not None:
            n = t * rows
            kernels.mmq_kernel("mmq_sum")(
                (-(-n // 256),),
                (256,),
                (part, np.int32(splits), out, np.int32(y.shape[1]), np.int32(rows), np.int32(t)),
            )

    @staticmethod
    def act_q8_k_i8(x: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray, cp.ndarray]:
        """x [T, K] rounded to q8_k as the int8 GEMMs take it: (int8 values [T, K], the scale of each
        256 [T, K / 256] float32, the sum of each 32 rounded values [T, K / 32] int32); the same
        rounding as `act_quant(x, "q8_k")`, whose values are these int8 times their scale."""
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        t, k = x.shape
        q = cp.empty((t, k), dtype=cp.int8)
        d = cp.empty((t, k // 256), dtype=cp.float32)
        s = cp.empty((t, k // 32), dtype=cp.int32)
        groups = t * k // 256
        kernels.mmq_kernel("act_q8_k_i8")(((groups + 7) // 8,), (256,), (x, q, d, s, np.int32(groups)))
        return q, d, s

    def _mmq_i8(self, p: QWeight, xq: tuple[cp.ndarray, cp.ndarray, cp.ndarray], y: cp.ndarray, col0: int) -> None:
        """y[:, col0 : col0 + rows] = x @ W.T for one piece of an `I8_TYPES` type with `mmq_i8_<T>`
        (64-token tiles), from `act_q8_k_i8`'s rounding of x; K split as `_mmq` splits it."""
        self._mmq_launch(f"mmq_i8_{p.type_name}", p, xq, y, col0, xq[0].shape[0], 64, None)

    def matmul(self, w: QWeight, x: cp.ndarray, bias: cp.ndarray | None, aq: str | None = None) -> cp.ndarray:
        """[T, in] x W.T for T > 1: with `mmq_h_<T>` (fp16 precision on sm_80+: `uses_mmq`) one
        kernel per piece reading the GGUF blocks; else tiles of W decoded into the tile buffer,
        one cuBLAS GemmEx per tile straight into the fp32 output (fp32 accumulation either way).
        `aq`: x is rounded first as llama.cpp does (`act_quant`), into fp16 where the product is."""
        self._settle()
        t = x.shape[0]
        rows, cols = w.shape
        y = cp.empty((t, rows), dtype=cp.float32)
        self._prefilled = True
        if self.uses_mmq(w, t):
            bases, base = [], 0
            for p in w.pieces():
                bases.append(base)
                base += p.shape[0]
            todo = list(zip(w.pieces(), bases, strict=True))
            if self.mmq_i8 and aq == "q8_k" and any(p.type_name in I8_TYPES for p, _ in todo):
                xq = self.act_q8_k_i8(x)  # freed before the fp16 rounding below: the plan's peak holds
                for p, b in todo:
                    if p.type_name in I8_TYPES:
                        self._mmq_i8(p, xq, y, b)
                del xq
                todo = [(p, b) for p, b in todo if p.type_name not in I8_TYPES]
            if todo:
                xs = self.act_quant(x, aq, half=True)
                for p, b in todo:
                    self._mmq(p, xs, y, b)
            if bias is not None:
                y += bias
            return y
        half = self.tile_dtype(w) == "float16"
        dt = np.dtype(np.float16 if half else np.float32)
        xs = cp.ascontiguousarray(self.act_quant(x, aq, half=half))
        buf = self._tiles(dt.itemsize, rows * cols)
        cap = buf.nbytes // dt.itemsize // cols
        base = 0
        for p in w.pieces():
            tile = tile_rows(p.shape[0], cap)
            for r0 in range(0, p.shape[0], tile):
                r1 = min(p.shape[0], r0 + tile)
                wt = buf[: (r1 - r0) * cols * dt.itemsize].view(dt).reshape(r1 - r0, cols)
                (self.dequant_f16 if half else self.dequant_f32)(p, r0, r1, wt)
                if self._gemm_ok.get(half) is not False:
                    self._gemm(wt, xs, y, base + r0)
                    if self._gemm_ok.get(half) is None:  # first use: check against cp.matmul once
                        n = min(t, 16)  # a few rows: enough to catch a wrong call, little memory
                        ref = cp.matmul(xs[:n], wt.T).astype(cp.float32)
                        got = y[:n, base + r0 : base + r1]
                        err = float(cp.abs(got - ref).max()) / max(float(cp.abs(ref).max()), 1e-30)
                        self._gemm_ok[half] = err < (1e-2 if half else 1e-4)
                        if not self._gemm_ok[half]:
                            log.warning("prefill GemmEx disagrees with cp.matmul (%.2e); using matmul", err)
                            y[:, base + r0 : base + r1] = cp.matmul(xs, wt.T)
                else:
                    y[:, base + r0 : base + r1] = cp.matmul(xs, wt.T)
            base += p.shape[0]
        if bias is not None:
            y += bias
        return y

    def linear(self, x: cp.ndarray, w: QWeight, b: cp.ndarray | None = None, aq: str | None = None) -> cp.ndarray:
        """[T, in] x [out, in] -> [T, out] (+ bias); `aq` rounds x as llama.cpp does."""
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        if x.shape[0] != 1:
            return self.matmul(w, x, b, aq)
        x = self.act_quant(x, aq)
        y = cp.empty((1, w.shape[0]), dtype=cp.float32)
        self.gemv(w, x, y[0], b)
        return y

    # --- math ----------------------------------------------------------------------------
    @staticmethod
    def rms_norm(x: cp.ndarray, w: cp.ndarray, eps: float) -> cp.ndarray:
        """RMSNorm over the last axis, scaled by `w`."""
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n = x.shape[-1]
        y = cp.empty_like(x)
        kernels.kernel("rms_norm")(
            (x.size // n,), (min(256, max(32, (n + 31) // 32 * 32)),), (x, w, y, np.int32(n), np.float32(eps))
        )
        return y

    @staticmethod
    def rope_tables(n_ctx: int, dim: int, base: float, scale: float) -> tuple[cp.ndarray, cp.ndarray]:
        """cos and sin, [n_ctx, dim/2] (computed in float64 on the host, as NumpyOps does)."""
        inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        ang = np.outer(np.arange(n_ctx, dtype=np.float64) / scale, inv)
        return cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))

    @staticmethod
    def rope(x: cp.ndarray, cos: cp.ndarray, sin: cp.ndarray, style: str) -> cp.ndarray:
        """Rotate [T, heads, D] by per-position [T, d/2] tables; d <= D dims rotate."""
        out = cp.array(x, dtype=cp.float32, order="C")  # always a copy: rotated in place
        t, h, d = out.shape
        half = cos.shape[-1]
        cos, sin = cp.ascontiguousarray(cos), cp.ascontiguousarray(sin)
        n = t * h * half
        kernels.kernel("rope")(
            ((n + 255) // 256,),
            (256,),
            (out, cos, sin, np.int32(t), np.int32(h), np.int32(d), np.int32(half), np.int32(style == "neox")),
        )
        return out

    @staticmethod
    def norm_rope(
        x: cp.ndarray, w: cp.ndarray | None, eps: float, cos: cp.ndarray, sin: cp.ndarray, style: str
    ) -> cp.ndarray:
        """`rope(rms_norm(x, w, eps))` (no norm where `w` is None) in one launch (`norm_rope`):
        heads [T, H, D] read in place from a view whose heads are contiguous rows of D values
        (the QKV output's columns), into a new contiguous float32 [T, H, D]."""
        t, h, d = x.shape
        if d > 1024:  # the kernel keeps a row in shared memory
            return CupyOps.rope(x if w is None else CupyOps.rms_norm(x, w, eps), cos, sin, style)
        if x.dtype != cp.float32 or x.strides[2] != 4 or x.strides[1] != 4 * d or x.strides[0] % 4:
            x = cp.ascontiguousarray(x, dtype=cp.float32)
        out = cp.empty((t, h, d), dtype=cp.float32)
        cos, sin = cp.ascontiguousarray(cos), cp.ascontiguousarray(sin)
        kernels.kernel("norm_rope")(
            (t * h,),
            (min(256, max(32, (d + 31) // 32 * 32)),),
            (
                x,
                np.int64(x.strides[0] // 4),
                _null() if w is None else w,
                out,
                np.int32(h),
                np.int32(d),
                np.float32(eps),
                cos,
                sin,
                np.int32(cos.shape[-1]),
                np.int32(style == "neox"),
            ),
        )
        return out

    @staticmethod
    def kv_store(cache: Any, start: int, x: cp.ndarray) -> None:
        """Write [T, KV, D] into the cache [KV, n_ctx, D] at positions start..start+T-1
        (an int8 cache: rounded by one kernel, `kv_store_int8`, the rule of engine.kv_cache)."""
        if not isinstance(cache, Int8Rows):
            kv_write(cp, cache, start, x)
            return
        t, kv, d = x.shape
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        warps = t * kv * (d // QBLOCK)
        kernels.kernel("kv_store_int8")(
            (-(-warps // 8),),
            (256,),
            (x, cache.q, cache.d, np.int32(t), np.int32(kv), np.int32(d), np.int32(cache.q.shape[1]), np.int32(start)),
        )

    def attention(
        self,
        q: cp.ndarray,
        k_cache: cp.ndarray,
        v_cache: cp.ndarray,
        start: int,
        window: int,
        scale: float,
    ) -> cp.ndarray:
        """Causal (optionally sliding-window) GQA attention -> [T, H*Dv]; decode uses a kernel."""
        t, h, d = q.shape
        kv, n_ctx, dv = v_cache.shape
        if t == 1 and d <= 512 and not isinstance(k_cache, Int8Rows):
            return decode_attention(q, k_cache, v_cache, start, window, scale)
        convert = k_cache.dtype != cp.float32  # f16 and int8 caches are converted into buffers
        key = (kv, n_ctx, d, dv, convert, h // kv)
        if self._attn is None or self._attn.key != key:
            self._attn = None  # give the old buffers back first
            self._attn = AttnBuffers(*key)
        return prefill_attention(q, k_cache, v_cache, start, window, scale, self._attn, self.attn_tf32)

    @staticmethod
    def gated_act(gate: cp.ndarray, up: cp.ndarray, kind: str) -> cp.ndarray:
        """SwiGLU (`silu`) or GeGLU with tanh GELU (`gelu_tanh`)."""
        if kind == "silu":
            return _silu(gate, up)
        return _gelu(gate, up, np.float32(_GELU_C))

    def make_decoder(self, transformer: object) -> object | None:
        """The one-token decode step as fused kernels replayed from a CUDA graph
        (`engine.backends.cupy_decoder`); `engine.Model` uses it for every single-token step."""
        # (called once per loaded model: also where its first-chunk prefill graphs are set up)
        from . import cupy_plan
        from .cupy_plan import later_graph_max, later_pool_bytes, prefill_graph_buckets

        self.finish_uploads()
        tf: Any = transformer
        # attention as precise as the model's products: TF32 where its QKV multiplies in fp16
        self.attn_tf32 = self.prefill_dtype != "float32" and any(
            isinstance(lw.wqkv, QWeight) and self.tile_dtype(lw.wqkv) == "float16" for lw in tf.layers
        )
        forced = self.options.cupy_prefill_graph
        buckets, shortest = prefill_graph_buckets(
            int(tf.weights_bytes), self.prefill_chunk, int(tf.n_ctx), forced, self.mmq_tokens if self.mmq else None
        )
        later = later_graph_max(self.prefill_chunk, int(tf.n_ctx), forced)
        if buckets or later:
            from .cupy_prefill_graph import PrefillGraphs

            mats = [w for lw in tf.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down) if isinstance(w, QWeight)]
            half = any(self.tile_dtype(w) == "float16" for w in mats)  # as the plan counts them
            pool = later_pool_bytes(tf.spec, later, half, self.mmq and self.mmq_split and half)
            large = forced is None and int(tf.weights_bytes) >= cupy_plan.GRAPH_MAX_WEIGHTS
            self.prefill_graphs = PrefillGraphs(buckets, later, pool, shortest, grouped_eager=large)
        if self.decoder_mode == "off":
            return None
        from .cupy_decoder import CupyDecoder

        return CupyDecoder(transformer, use_graph=self.decoder_mode == "graph", options=self.options)

    @staticmethod
    def argmax(logits: cp.ndarray) -> int:
        """Greedy sampling on the device: only the token id comes back to the host."""
        x = cp.ascontiguousarray(logits.reshape(-1), dtype=cp.float32)
        out = cp.empty((1,), dtype=cp.int64)
        kernels.kernel("argmax")((1,), (1024,), (x, np.int32(x.size), out))
        return int(out.get()[0])


_CHECKED: type[Ops] = CupyOps
"""CupyOps is an `Ops` (mypy checks it here, cupy itself being untyped: its arrays are Any)."""
