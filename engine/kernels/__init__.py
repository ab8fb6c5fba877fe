"""CUDA kernels of the CuPy backend, as CUDA C strings compiled at run time (NVRTC) for the GPU present.

`quant_units`: per tensor type, a decoder of 32 values plus the GEMV / dequantize / gather
kernels built on it. `ops_src`: activation rounding, RMSNorm, RoPE, decode attention, argmax.
Each kernel has a NumPy twin in `engine.backends.numpy_backend` or `engine.quants`, and a test in
`tests/test_cupy_backend.py`.
"""

from __future__ import annotations

from functools import cache, lru_cache
from typing import Any

from . import mmq_src, ops_src, quant_units

TYPES = quant_units.TYPES


def full_source() -> str:
    """The whole translation unit (also handy for `nvcc -arch=sm_90 -c` checks)."""
    return quant_units.source() + ops_src.source()


@lru_cache(maxsize=1)
def module() -> Any:
    """The compiled module (compiled once per process, cached on disk by CuPy)."""
    import cupy as cp

    return cp.RawModule(code=full_source(), options=("--std=c++17",))


def kernel(name: str) -> Any:
    return _kernel(name)


def mmq_source() -> str:
    """The prefill GEMMs' translation unit (`mmq_src`, after the unit decoders): its own module,
    so a GPU below sm_80 (no mma.sync), which never launches them, never compiles them either."""
    return quant_units.UNITS + mmq_src.source()


@lru_cache(maxsize=1)
def mmq_module() -> Any:
    """The compiled `mmq_src` module (once per process, cached on disk by CuPy)."""
    import cupy as cp

    return cp.RawModule(code=mmq_source(), options=("--std=c++17",))


@cache
def mmq_kernel(name: str) -> Any:
    """`mmq_h_<T>`, `mmq_w_<T>` or `mmq_sum` from `mmq_module`."""
    return mmq_module().get_function(name)


@cache
def _kernel(name: str) -> Any:
    return module().get_function(name)
