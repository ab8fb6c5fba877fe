"""The CuPy backend's cuBLAS GEMMs: float32 outputs, fp32 accumulation (TF32 inputs only where asked), on the calling
thread's stream, through ctypes (`cupy_launch.cublas`: callable during a stream capture) where the
library is found, else through CuPy's wrappers."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas as _cublas

from .cupy_launch import cublas

# cuBLAS / CUDA enum values (cublas_api.h, library_types.h)
OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F = 0, 2
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation (tensor cores for fp16 inputs, no TF32)
_COMPUTE_32F_FAST_TF32 = 77  # CUBLAS_COMPUTE_32F_FAST_TF32: fp32 inputs rounded to TF32 on tensor cores
_GEMM_DEFAULT = -1
_ONE = np.ones(1, dtype=np.float32)
_ZERO = np.zeros(1, dtype=np.float32)


class _CupyBlas:
    """CuPy's cuBLAS wrappers behind `Cublas`'s names (where ctypes cannot reach the library)."""

    set_stream = staticmethod(_cublas.setStream)
    gemm_ex = staticmethod(_cublas.gemmEx)
    gemm_strided_batched_ex = staticmethod(_cublas.gemmStridedBatchedEx)


def _blas() -> Any:
    """cuBLAS calls that also work during stream capture (`cupy_launch.cublas`), else CuPy's."""
    return cublas() or _CupyBlas


def gemm(
    opa: int,
    opb: int,
    m: int,
    n: int,
    k: int,
    a: int,
    lda: int,
    b: int,
    ldb: int,
    c: int,
    ldc: int,
    in_type: int = CUDA_R_32F,
    batched: tuple[int, int, int, int] | None = None,
    tf32: bool = False,
) -> None:
    """C [m, n] = op(A) op(B) (cuBLAS column-major) on device pointers: `a` and `b` of `in_type`
    (CUDA_R_16F or CUDA_R_32F), `c` float32. `batched` (stride_a, stride_b, stride_c in values,
    count): `count` strided GEMMs in one GemmStridedBatchedEx; None: one GemmEx. `tf32`: float32
    inputs rounded to TF32 (10-bit mantissa, as fp16) on the tensor cores, fp32 accumulation."""
    handle = cp.cuda.device.get_cublas_handle()
    blas = _blas()
    blas.set_stream(handle, cp.cuda.get_current_stream().ptr)
    head = (handle, opa, opb, m, n, k, _ONE.ctypes.data)
    tail = (_COMPUTE_32F_FAST_TF32 if tf32 else _COMPUTE_32F, _GEMM_DEFAULT)
    zero = _ZERO.ctypes.data
    if batched is None:
        blas.gemm_ex(*head, a, in_type, lda, b, in_type, ldb, zero, c, CUDA_R_32F, ldc, *tail)
        return
    sa, sb, sc, count = batched
    blas.gemm_strided_batched_ex(
        *head, a, in_type, lda, sa, b, in_type, ldb, sb, zero, c, CUDA_R_32F, ldc, sc, count, *tail
    )
