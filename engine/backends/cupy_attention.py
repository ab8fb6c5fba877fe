"""The CuPy backend's attention: one query row by a kernel (decode), several (prefill) by
strided-batched cuBLAS GEMMs over blocks of query rows whose scores fit a fixed buffer."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from .. import kernels
from ..kv_cache import QBLOCK, Int8Rows
from .cupy_blas import OP_N, OP_T, gemm
from .cupy_plan import score_elems

_dequant_int8 = cp.ElementwiseKernel(  # int8 KV rows: value x its block's fp16 scale (broadcast)
    "int8 q, float16 d", "float32 y", "y = (float)q * (float)d", "genie_kv_int8_rows"
)


def decode_attention(
    q: cp.ndarray, k_cache: cp.ndarray, v_cache: cp.ndarray, start: int, window: int, scale: float
) -> cp.ndarray:
    """One query position (T = 1) against an f32 or f16 cache, one block per head -> [1, H*Dv]."""
    _, h, d = q.shape
    kv, n_ctx, dv = v_cache.shape
    end = start + 1
    lo = max(0, start - window + 1) if window else 0
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


class AttnBuffers:
    """Prefill attention's fixed buffers for one cache shape: float32 K/V rows [KV, n_ctx, D]
    (when the cache must be converted: f16) and the score block (`cupy_plan.score_elems`)."""

    def __init__(self, kv: int, n_ctx: int, d: int, dv: int, convert: bool, group: int = 1) -> None:
        self.key = (kv, n_ctx, d, dv, convert, group)
        self.k = cp.empty((kv, n_ctx, d), dtype=cp.float32) if convert else None
        self.v = cp.empty((kv, n_ctx, dv), dtype=cp.float32) if convert else None
        self.scores = cp.empty(score_elems(kv, n_ctx, group), dtype=cp.float32)


def _kv_f32(cache: Any, lo: int, end: int, buf: cp.ndarray | None) -> tuple[cp.ndarray, int]:
    """Positions lo..end-1 of one layer's K or V cache as float32 rows for cuBLAS: (array
    [KV, rows, D], the row that holds position lo). The one place prefill attention reads the
    cache: an f32 cache is read in place, f16 is converted and int8 dequantized (one fused
    kernel, `kv_cache.dequantize_rows`' rule) into the preallocated `buf` [KV, n_ctx, D]."""
    if not isinstance(cache, Int8Rows) and cache.dtype == cp.float32:
        return cp.ascontiguousarray(cache), lo
    assert buf is not None  # AttnBuffers converts every non-f32 cache
    if isinstance(cache, Int8Rows):
        kv, _, d = cache.q.shape
        q = cache.q[:, lo:end, :].reshape(kv, end - lo, d // QBLOCK, QBLOCK)
        _dequant_int8(q, cache.d[:, lo:end, :, None], buf[:, : end - lo].reshape(q.shape))
    else:
        cp.copyto(buf[:, : end - lo], cache[:, lo:end, :])  # k = k_cache[:, lo:end].astype(float32)
    return buf, 0


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
    tf32: bool = False,
) -> None:
    """`batch` strided float32 GEMMs C = op(A) op(B) (cuBLAS column-major; fp32 accumulation,
    inputs rounded to TF32 where `tf32`) on float32 arrays a, b, c; offsets and strides in values."""
    ptr_a, ptr_b, ptr_c = a.data.ptr + 4 * a_off, b.data.ptr + 4 * b_off, c.data.ptr + 4 * c_off
    gemm(
        opa, opb, m, n, k, ptr_a, lda, ptr_b, ldb, ptr_c, ldc, batched=(stride_a, stride_b, stride_c, batch), tf32=tf32
    )


def prefill_attention(
    q: cp.ndarray,
    k_cache: Any,
    v_cache: Any,
    start: int,
    window: int,
    scale: float,
    bufs: AttnBuffers,
    tf32: bool = False,
) -> cp.ndarray:
    """NumpyOps.attention for several query positions (prefill) -> [T, H*Dv].

    The queries are laid out as [KV, T, G, D] (one copy), so the rows of every member of a GQA
    group sit together under their KV head; then for each block of query rows whose scores fit
    `bufs.scores`: scores S[kv] [rows x G, keys] = Q[kv] K[kv]^T (one strided-batched GEMM over
    the KV heads, K read straight from the cache rows), scale + causal/sliding mask + softmax in
    place (`causal_softmax`, query row r / G), O[kv] = P[kv] V[kv] (one strided-batched GEMM) into
    [KV, T, G, Dv], copied back to [T, H*Dv] at the end. Three launches a block for the whole
    group instead of three per member (before: a Qwen3-4B chunk at 2,000 positions made 12).
    `tf32`: both GEMMs round their float32 inputs to TF32 (the precision of an fp16 K/V cache) on
    the tensor cores, fp32 accumulation; False: fp32 throughout.
    """
    t, h, d = q.shape
    kv, _, dv = v_cache.shape
    g = h // kv
    end = start + t
    lo = max(0, start - window + 1) if window else 0
    qg = cp.ascontiguousarray(q.reshape(t, kv, g, d).transpose(1, 0, 2, 3), dtype=cp.float32)  # [KV, T, G, D]
    og = cp.empty((kv, t, g, dv), dtype=cp.float32)
    k, k0 = _kv_f32(k_cache, lo, end, bufs.k)  # K [KV, rows, D]: position p in row k0 + p - lo
    v, v0 = _kv_f32(v_cache, lo, end, bufs.v)
    s = bufs.scores
    tb = max(1, min(t, s.size // (kv * g * (end - lo))))  # query rows per block
    softmax = kernels.kernel("causal_softmax")
    for a in range(0, t, tb):
        n = min(t, a + tb) - a
        blo = max(lo, start + a - window + 1) if window else lo  # first key the block sees
        keys = start + a + n - blo
        # S[kv] [n*G, keys] (column-major [keys, n*G]) = K[kv][blo..] . Q[kv][a..]
        _bgemm(
            OP_T,
            OP_N,
            keys,
            n * g,
            d,
            k,
            (k0 + blo - lo) * d,
            d,
            k.shape[1] * d,
            qg,
            a * g * d,
            d,
            t * g * d,
            s,
            0,
            keys,
            n * g * keys,
            kv,
            tf32,
        )
        # row r = (kv * n + i) * G + gi is query start + a + i
        softmax(
            (kv * n * g,),
            (256,),
            (
                s,
                np.int32(keys),
                np.int32(n),
                np.int32(g),
                np.int32(start + a),
                np.int32(blo),
                np.int32(window),
                np.float32(scale),
            ),
        )
        # O[kv][a..] (column-major [Dv, n*G]) = V[kv][blo..]^T-view . P[kv]
        _bgemm(
            OP_N,
            OP_N,
            dv,
            n * g,
            keys,
            v,
            (v0 + blo - lo) * dv,
            dv,
            v.shape[1] * dv,
            s,
            0,
            keys,
            n * g * keys,
            og,
            a * g * dv,
            dv,
            t * g * dv,
            kv,
            tf32,
        )
    return og.transpose(1, 0, 2, 3).reshape(t, h * dv)
