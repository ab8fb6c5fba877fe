"""CuPy backend: the ops of the forward pass on a CUDA GPU, weights kept quantized on the device.

Weights stay in their GGUF block layout in GPU memory (`QWeight`). One token (decode) runs fused
dequantize+GEMV kernels (one warp per row); several tokens (prefill) dequantize row tiles into one
preallocated tile buffer - fp16 (tensor cores) for large matrices, fp32 for small ones and for
stored F32/BF16 (`prefill_dtype="auto"`, the default; or "float16" / "float32" everywhere) - and
multiply them with one cuBLAS GemmEx per tile, fp32 accumulation, written straight into the
output. Prefill attention runs strided-batched GEMMs in blocks of query rows whose scores fit a
fixed buffer. What all this allocates is planned before load: `cupy_plan`. Kernels: `engine.kernels`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas as _cublas

from .. import kernels
from ..gguf_file import TensorInfo
from ..kv_cache import QBLOCK, Int8Rows, kv_write
from ..options import DEFAULT_OPTIONS, EngineOptions
from ..quants import dequantize, dequantize_rows
from .cupy_launch import cublas
from .cupy_plan import (
    PREFILL_CHUNK,
    SCRATCH_ELEMS,
    resolve_prefill_dtype,
    score_elems,
    tile_dtype,
)

log = logging.getLogger(__name__)

_GELU_C = math.sqrt(2.0 / math.pi)
# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_CUDA_R_32F, _CUDA_R_16F = 0, 2
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation (tensor cores for fp16 inputs, no TF32)
_GEMM_DEFAULT = -1
_ONE = np.ones(1, dtype=np.float32)
_ZERO = np.zeros(1, dtype=np.float32)
WARPS = 4  # rows per GEMV block

_dequant_int8 = cp.ElementwiseKernel(  # int8 KV rows: value x its block's fp16 scale (broadcast)
    "int8 q, float16 d", "float32 y", "y = (float)q * (float)d", "genie_kv_int8_rows"
)
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
        self.decoder_mode = self.options.cupy_decoder
        """One-token steps: "graph" (fused kernels replayed from a CUDA graph), "eager" (the same
        kernels launched one by one) or "off" (the generic forward pass)."""
        self.prefill_dtype = resolve_prefill_dtype(prefill_dtype, self.options.cupy_prefill)
        """Prefill tile precision: "auto" (fp16 tiles for matrices of >= 4M values except stored
        F32/BF16, fp32 otherwise; `cupy_plan.tile_dtype`), "float16" or "float32" (exact to
        ~1e-6, what the whole-model tests pin); None: the options' `cupy_prefill`."""
        self._scratch: cp.ndarray | None = None  # tile buffer (uint8), see _tiles
        self._max_elems = 0  # values of the largest fused matrix (QKV, gate+up): sizes the tiles
        self._attn: _AttnBuffers | None = None
        self._gemm_ok: dict[bool, bool] = {}  # per fp16/fp32: GemmEx checked against cp.matmul
        self.prefill_graphs: Any = None  # first-chunk graphs (cupy_prefill_graph), set per model

    # --- weights -------------------------------------------------------------------------
    def weight(self, t: TensorInfo) -> QWeight | cp.ndarray:
        """2-D: raw bytes on the device (QWeight); 1-D (norms, biases): float32 array."""
        if len(t.shape) != 2:
            return cp.asarray(dequantize(t.raw, t.type_name, t.shape))
        raw = np.ascontiguousarray(t.raw).view(np.uint8).reshape(t.shape[0], -1)
        return QWeight(cp.asarray(raw), t.type_name, (int(t.shape[0]), int(t.shape[1])))

    def concat_rows(self, parts: list[QWeight]) -> QWeight:
        """Stack weights by rows: one buffer when the types agree, else a list of pieces."""
        cols = parts[0].shape[1]
        rows = sum(p.shape[0] for p in parts)
        self._max_elems = max(self._max_elems, rows * cols)
        if len({p.type_name for p in parts}) == 1 and all(not p.parts for p in parts):
            raw = cp.concatenate([p.raw for p in parts], axis=0)
            for p in parts:
                p.raw = None  # free the pieces...
            # ...and give them back to CUDA now: cached, they would be split by the next small
            # allocations and stay in the pool as fragments (the plan counts no load leftovers)
            cp.get_default_memory_pool().free_all_blocks()
            return QWeight(raw, parts[0].type_name, (rows, cols))
        pieces = [q for p in parts for q in p.pieces()]
        return QWeight(None, "mixed", (rows, cols), pieces)

    def embed_rows(self, table: QWeight | TensorInfo, ids: np.ndarray, cols: int) -> cp.ndarray:
        """Rows of the embedding table [T] -> [T, E]; a host-side table is decoded on the host."""
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
    def act_quant(x: cp.ndarray, kind: str | None) -> cp.ndarray:
        """llama.cpp's activation rounding on the device (NumpyOps.act_quant's twin)."""
        if kind is None:
            return x
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        y = cp.empty_like(x)
        groups = x.size // (32 if kind == "q8_0" else 256)
        per_block = 8
        kernels.kernel("act_q8_0" if kind == "q8_0" else "act_q8_k")(
            ((groups + per_block - 1) // per_block,), (32 * per_block,), (x, y, np.int32(groups))
        )
        return y

    def gemv(self, w: QWeight, x: cp.ndarray, y: cp.ndarray, bias: cp.ndarray | None) -> None:
        """y[rows] = W @ x (+ bias) with the fused dequantize+GEMV kernel of W's type."""
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
        self._dequant("dequant_h", p, r0, r1, out)

    def dequant_f32(self, p: QWeight, r0: int, r1: int, out: cp.ndarray) -> None:
        """Rows r0..r1 of one piece as fp32 into `out` [r1 - r0, cols]."""
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
        dt = _CUDA_R_16F if wt.dtype == cp.float16 else _CUDA_R_32F
        handle = cp.cuda.device.get_cublas_handle()
        blas = _blas()
        blas.set_stream(handle, cp.cuda.get_current_stream().ptr)
        # column-major view: C[m, t] (ldc = y's row length) = op(A = wt as [k, m])^T [m, k] x B [k, t]
        blas.gemm_ex(
            handle,
            _OP_T,
            _OP_N,
            m,
            t,
            k,
            _ONE.ctypes.data,
            wt.data.ptr,
            dt,
            k,
            xs.data.ptr,
            dt,
            k,
            _ZERO.ctypes.data,
            y.data.ptr + col0 * 4,
            _CUDA_R_32F,
            y.shape[1],
            _COMPUTE_32F,
            _GEMM_DEFAULT,
        )

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

    def matmul(self, w: QWeight, x: cp.ndarray, bias: cp.ndarray | None) -> cp.ndarray:
        """[T, in] x W.T for T > 1: tiles of W decoded into the tile buffer, one cuBLAS GemmEx
        per tile straight into the fp32 output (fp32 accumulation for fp16 tiles too)."""
        t = x.shape[0]
        rows, cols = w.shape
        y = cp.empty((t, rows), dtype=cp.float32)
        half = self.tile_dtype(w) == "float16"
        dt = np.dtype(np.float16 if half else np.float32)
        xs = cp.ascontiguousarray(x.astype(cp.float16) if half else x)
        buf = self._tiles(dt.itemsize, rows * cols)
        tile = max(1, buf.nbytes // dt.itemsize // cols)
        base = 0
        for p in w.pieces():
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
        x = self.act_quant(cp.ascontiguousarray(x, dtype=cp.float32), aq)
        if x.shape[0] != 1:
            return self.matmul(w, x, b)
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
        end = start + t
        lo = max(0, start - window + 1) if window else 0
        if t == 1 and d <= 512 and not isinstance(k_cache, Int8Rows):
            qc = cp.ascontiguousarray(q, dtype=cp.float32)
            out = cp.empty((1, h * dv), dtype=cp.float32)
            scores = cp.empty((h, n_ctx), dtype=cp.float32)
            name = "attn_decode_half" if k_cache.dtype == cp.float16 else "attn_decode_float"
            kernels.kernel(name)(
                (h,),
                (256,),
                (
                    qc,
                    k_cache,
                    v_cache,
                    out,
                    scores,
                    np.int32(h // kv),
                    np.int32(d),
                    np.int32(dv),
                    np.int32(n_ctx),
                    np.int32(lo),
                    np.int32(end),
                    np.float32(scale),
                ),
            )
            return out
        convert = k_cache.dtype != cp.float32  # f16 and int8 caches are converted into buffers
        key = (kv, n_ctx, d, dv, convert)
        if self._attn is None or self._attn.key != key:
            self._attn = None  # give the old buffers back first
            self._attn = _AttnBuffers(*key)
        return _attention_xp(q, k_cache, v_cache, start, window, scale, self._attn)

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
        from .cupy_plan import prefill_graph_buckets

        tf: Any = transformer
        buckets = prefill_graph_buckets(
            int(tf.weights_bytes), self.prefill_chunk, int(tf.n_ctx), self.options.cupy_prefill_graph
        )
        if buckets:
            from .cupy_prefill_graph import PrefillGraphs

            self.prefill_graphs = PrefillGraphs(buckets)
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


class _AttnBuffers:
    """Prefill attention's fixed buffers for one cache shape: float32 K/V rows [KV, n_ctx, D]
    (when the cache must be converted: f16) and the score block (`cupy_plan.score_elems`)."""

    def __init__(self, kv: int, n_ctx: int, d: int, dv: int, convert: bool) -> None:
        self.key = (kv, n_ctx, d, dv, convert)
        self.k = cp.empty((kv, n_ctx, d), dtype=cp.float32) if convert else None
        self.v = cp.empty((kv, n_ctx, dv), dtype=cp.float32) if convert else None
        self.scores = cp.empty(score_elems(kv, n_ctx), dtype=cp.float32)


def _kv_f32(cache: Any, lo: int, end: int, buf: cp.ndarray | None) -> tuple[cp.ndarray, int]:
    """Positions lo..end-1 of one layer's K or V cache as float32 rows for cuBLAS: (array
    [KV, rows, D], the row that holds position lo). The one place prefill attention reads the
    cache: an f32 cache is read in place, f16 is converted and int8 dequantized (one fused
    kernel, `kv_cache.dequantize_rows`' rule) into the preallocated `buf` [KV, n_ctx, D]."""
    if not isinstance(cache, Int8Rows) and cache.dtype == cp.float32:
        return cp.ascontiguousarray(cache), lo
    assert buf is not None  # _AttnBuffers converts every non-f32 cache
    if isinstance(cache, Int8Rows):
        kv, _, d = cache.q.shape
        q = cache.q[:, lo:end, :].reshape(kv, end - lo, d // QBLOCK, QBLOCK)
        _dequant_int8(q, cache.d[:, lo:end, :, None], buf[:, : end - lo].reshape(q.shape))
    else:
        cp.copyto(buf[:, : end - lo], cache[:, lo:end, :])  # k = k_cache[:, lo:end].astype(float32)
    return buf, 0


class _CupyBlas:
    """CuPy's cuBLAS wrappers behind `Cublas`'s names (where ctypes cannot reach the library)."""

    set_stream = staticmethod(_cublas.setStream)
    gemm_ex = staticmethod(_cublas.gemmEx)
    gemm_strided_batched_ex = staticmethod(_cublas.gemmStridedBatchedEx)


def _blas() -> Any:
    """cuBLAS calls that also work during stream capture (`cupy_launch.cublas`), else CuPy's."""
    return cublas() or _CupyBlas


def _bgemm(
    opa: int,
    opb: int,
    m: int,
    n: int,
    k: int,
    a: cp.ndarray,
    a_off: int,
    lda: int,
    stride_a: int,
    b: cp.ndarray,
    b_off: int,
    ldb: int,
    stride_b: int,
    c: cp.ndarray,
    c_off: int,
    ldc: int,
    stride_c: int,
    batch: int,
) -> None:
    """`batch` strided float32 GEMMs C = op(A) op(B) (cuBLAS column-major; fp32 compute, no TF32)
    on float32 arrays a, b, c; offsets and strides in values."""
    handle = cp.cuda.device.get_cublas_handle()
    blas = _blas()
    blas.set_stream(handle, cp.cuda.get_current_stream().ptr)
    blas.gemm_strided_batched_ex(
        handle,
        opa,
        opb,
        m,
        n,
        k,
        _ONE.ctypes.data,
        a.data.ptr + 4 * a_off,
        _CUDA_R_32F,
        lda,
        stride_a,
        b.data.ptr + 4 * b_off,
        _CUDA_R_32F,
        ldb,
        stride_b,
        _ZERO.ctypes.data,
        c.data.ptr + 4 * c_off,
        _CUDA_R_32F,
        ldc,
        stride_c,
        batch,
        _COMPUTE_32F,
        _GEMM_DEFAULT,
    )


def _attention_xp(
    q: cp.ndarray,
    k_cache: Any,
    v_cache: Any,
    start: int,
    window: int,
    scale: float,
    bufs: _AttnBuffers,
) -> cp.ndarray:
    """NumpyOps.attention for several query positions (prefill) -> [T, H*Dv].

    For each block of query rows whose scores fit `bufs.scores` and each member gi of a GQA
    group: scores S[kv] = Q[rows, head kv*G+gi] K[kv]^T (one strided-batched GEMM over the KV
    heads, read straight from the cache rows), scale + causal/sliding mask + softmax in place
    (`causal_softmax`), then out[rows, head kv*G+gi] = P[kv] V[kv] written straight into the
    output's columns. Nothing is allocated but the output (and an int8 cache's dequantized rows).
    """
    t, h, d = q.shape
    kv, _, dv = v_cache.shape
    g = h // kv
    end = start + t
    lo = max(0, start - window + 1) if window else 0
    q = cp.ascontiguousarray(q, dtype=cp.float32)  # [T, H, D]
    out = cp.empty((t, h * dv), dtype=cp.float32)
    k, k0 = _kv_f32(k_cache, lo, end, bufs.k)  # K [KV, rows, D]: position p in row k0 + p - lo
    v, v0 = _kv_f32(v_cache, lo, end, bufs.v)
    s = bufs.scores
    tb = max(1, min(t, s.size // (kv * (end - lo))))  # query rows per block
    softmax = kernels.kernel("causal_softmax")
    for a in range(0, t, tb):
        n = min(t, a + tb) - a
        blo = max(lo, start + a - window + 1) if window else lo  # first key the block sees
        keys = start + a + n - blo
        for gi in range(g):
            # S[kv] [n, keys] (column-major [keys, n]) = K[kv][blo..] . Q[a.., head kv*g+gi]
            _bgemm(
                _OP_T,
                _OP_N,
                keys,
                n,
                d,
                k,
                (k0 + blo - lo) * d,
                d,
                k.shape[1] * d,
                q,
                (a * h + gi) * d,
                h * d,
                g * d,
                s,
                0,
                keys,
                n * keys,
                kv,
            )
            # row r = kv * n + i is query start + a + i
            softmax(
                (kv * n,),
                (256,),
                (
                    s,
                    np.int32(keys),
                    np.int32(n),
                    np.int32(1),
                    np.int32(start + a),
                    np.int32(blo),
                    np.int32(window),
                    np.float32(scale),
                ),
            )
            # out[a.., head kv*g+gi] (column-major [Dv, n], ld H*Dv) = V[kv][blo..]^T-view . P[kv]
            _bgemm(
                _OP_N,
                _OP_N,
                dv,
                n,
                keys,
                v,
                (v0 + blo - lo) * dv,
                dv,
                v.shape[1] * dv,
                s,
                0,
                keys,
                n * keys,
                out,
                (a * h + gi) * dv,
                h * dv,
                g * dv,
                kv,
            )
    return out
