"""cuBLAS's GemmEx and GemmStridedBatchedEx for the host stand-in of CuPy (`tests/host_cupy/cupy`):
column-major C = alpha op(A) op(B) + beta C on raw host pointers, float32 or float16 inputs,
float32 outputs (fp32 accumulation, as the engine asks), queued on the handle's stream."""

from __future__ import annotations

import ctypes
from typing import Any

import cupy
import numpy as np

CUDA_R_32F, CUDA_R_16F = 0, 2
_DTYPE = {CUDA_R_32F: np.float32, CUDA_R_16F: np.float16}
_stream: dict[int, int] = {}


def setStream(handle: int, stream: int) -> None:  # noqa: N802 - cuBLAS's names
    _stream[int(handle)] = int(stream or 0)


def _scalar(ptr: int) -> float:
    return float(ctypes.c_float.from_address(int(ptr)).value)


def _matrix(ptr: int, kind: int, rows: int, cols: int, ld: int) -> np.ndarray:
    """The column-major [rows, cols] matrix at `ptr` with leading dimension `ld` (a view)."""
    dt = np.dtype(_DTYPE[kind])
    n = ld * (cols - 1) + rows
    buf = (ctypes.c_char * (n * dt.itemsize)).from_address(int(ptr))
    flat = np.frombuffer(buf, dtype=dt, count=n)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (dt.itemsize, ld * dt.itemsize))


def _gemm(opa: int, opb: int, m: int, n: int, k: int, alpha: float, a: Any, b: Any, beta: float, c: Any) -> None:
    """C = alpha op(A) op(B) + beta C; `a`, `b`, `c`: (pointer, type, leading dimension)."""
    (pa, ta, lda), (pb, tb, ldb), (pc, tc, ldc) = a, b, c
    if tc != CUDA_R_32F:
        raise NotImplementedError("host cublas: float32 outputs only")
    am = _matrix(pa, ta, k, m, lda).T if opa else _matrix(pa, ta, m, k, lda)
    bm = _matrix(pb, tb, n, k, ldb).T if opb else _matrix(pb, tb, k, n, ldb)
    cm = _matrix(pc, tc, m, n, ldc)
    prod = np.matmul(am.astype(np.float32), bm.astype(np.float32))
    cm[...] = alpha * prod + (beta * cm if beta else 0.0)


def _queue(handle: int, op: Any) -> None:
    cupy._queue(op, cupy._stream_at(_stream.get(int(handle))))


def gemmEx(handle: int, opa: int, opb: int, m: int, n: int, k: int, alpha: int, *rest: Any) -> None:  # noqa: N802
    """cublasGemmEx's arguments: ..., A, A type, lda, B, B type, ldb, beta, C, C type, ldc, compute, algo."""
    a, b, (beta, *c) = rest[0:3], rest[3:6], rest[6:10]
    al, be = _scalar(alpha), _scalar(beta)
    _queue(handle, lambda: _gemm(opa, opb, m, n, k, al, a, b, be, c))


def gemmStridedBatchedEx(handle: int, opa: int, opb: int, m: int, n: int, k: int, alpha: int, *rest: Any) -> None:  # noqa: N802
    """cublasGemmStridedBatchedEx's arguments: ..., A, A type, lda, stride A, B, B type, ldb,
    stride B, beta, C, C type, ldc, stride C, count, compute, algo (strides in values)."""
    pa, ta, lda, sa, pb, tb, ldb, sb, beta, pc, tc, ldc, sc, count = rest[:14]
    al, be = _scalar(alpha), _scalar(beta)
    ia, ib = np.dtype(_DTYPE[ta]).itemsize, np.dtype(_DTYPE[tb]).itemsize

    def run() -> None:
        for i in range(count):
            a, b, c = (pa + i * sa * ia, ta, lda), (pb + i * sb * ib, tb, ldb), (pc + i * sc * 4, tc, ldc)
            _gemm(opa, opb, m, n, k, al, a, b, be, c)

    _queue(handle, run)
