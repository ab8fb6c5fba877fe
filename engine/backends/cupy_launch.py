"""Kernel launches with Programmatic Dependent Launch (PDL), through the CUDA driver API.

A decode step is ~10 launches a layer of 2-13 us each; between two kernels of a stream the GPU
drains the first, then starts the second, whose blocks then wait a DRAM round trip for their first
weight bytes. With PDL (compute capability 9.0+, CUDA 12.3+ drivers for graphs) a kernel launched
with the `PROGRAMMATIC_STREAM_SERIALIZATION` attribute may start while the kernel before it still
runs: its blocks load their first weights, then wait (`griddepcontrol.wait`, the `PDL_WAIT` macro
of `engine.kernels.decode_src`) until every earlier kernel has finished and its writes are
visible. Stream capture records the launch as a programmatic edge of the CUDA graph.

CuPy's `RawKernel` call has no launch attributes, so `PdlLaunch` calls `cuLaunchKernelEx` from
`libcuda` with ctypes, on the CUfunction CuPy compiled. Where the driver, the GPU or the library
lacks it, `pdl_launcher()` returns None and callers launch through CuPy as before.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attr(ctypes.Structure):
    """CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attr)),
        ("numAttrs", ctypes.c_uint),
    ]


def _arg(a: Any) -> Any:
    """One kernel argument as a ctypes object holding its bytes (device pointer or scalar)."""
    if isinstance(a, np.generic):
        return (ctypes.c_char * a.nbytes).from_buffer_copy(a.tobytes())
    ptr = getattr(getattr(a, "data", None), "ptr", None)  # cupy.ndarray
    if ptr is None:
        raise TypeError(f"kernel argument of type {type(a).__name__}: pass a CuPy array or a NumPy scalar")
    return ctypes.c_void_p(int(ptr))


class PdlLaunch:
    """One launch prepared for `cuLaunchKernelEx` with the PDL attribute (arguments fixed)."""

    __slots__ = ("_lib", "_fn", "_cfg", "_attr", "_vals", "_params")

    def __init__(
        self, lib: Any, fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], smem: int
    ) -> None:
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        self._lib = lib
        self._fn = ctypes.c_void_p(int(getattr(fn, "kernel", fn).ptr))  # RawKernel -> CUfunction
        self._attr = _Attr()
        self._attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value[0] = 1
        self._cfg = _Config(g[0], g[1], g[2], b[0], b[1], b[2], smem, None, ctypes.pointer(self._attr), 1)
        self._vals = [_arg(a) for a in args]
        self._params = (ctypes.c_void_p * max(1, len(self._vals)))(*[ctypes.addressof(v) for v in self._vals])

    def __call__(self, stream_ptr: int) -> None:
        self._cfg.hStream = stream_ptr
        rc = self._lib.cuLaunchKernelEx(ctypes.byref(self._cfg), self._fn, self._params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed: {_error_name(self._lib, rc)}")


def _error_name(lib: Any, rc: int) -> str:
    name = ctypes.c_char_p()
    if lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
        return f"{name.value.decode()} ({rc})"
    return f"CUresult {rc}"


def pdl_launcher(enabled: bool = True) -> Any:
    """libcuda with `cuLaunchKernelEx` where PDL is usable on the current device (compute
    capability >= 9.0, driver >= 12.3) and `enabled` (`EngineOptions.cupy_pdl`), else None (why:
    logged); None when not enabled without any CUDA call."""
    return _pdl_library() if enabled else None


@lru_cache(maxsize=1)
def _pdl_library() -> Any:
    import cupy as cp

    try:
        cc = int(cp.cuda.Device().compute_capability)  # "90" for 9.0, as cupy_plan and the decoder read it
        driver = int(cp.cuda.runtime.driverGetVersion())
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuGetErrorName.restype = ctypes.c_int
    except (OSError, AttributeError, cp.cuda.runtime.CUDARuntimeError) as exc:
        log.info("programmatic dependent launch unavailable: %s", exc)
        return None
    if cc < 90 or driver < 12030:
        log.info("programmatic dependent launch unavailable: compute capability %d, driver %d", cc, driver)
        return None
    return lib


class Cublas:
    """`cublasSetStream_v2`, `cublasGemmEx` and `cublasGemmStridedBatchedEx` called through ctypes
    on the cuBLAS library CuPy loaded, with CuPy's handle. CuPy's own wrappers refuse to run while
    a stream is being captured (cuBLAS itself records into graphs), which the first-chunk prefill
    graphs (`cupy_prefill_graph`) need; `cublas()` gives None where the library is not found, and
    callers then use CuPy's wrappers."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        lib.cublasGemmStridedBatchedEx.argtypes = [
            vp,
            i,
            i,
            i,
            i,
            i,
            vp,
            vp,
            i,
            i,
            ll,
            vp,
            i,
            i,
            ll,
            vp,
            vp,
            i,
            i,
            ll,
            i,
            i,
            i,
        ]
        for f in (lib.cublasSetStream_v2, lib.cublasGemmEx, lib.cublasGemmStridedBatchedEx):
            f.restype = ctypes.c_int

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: cublasStatus {rc}")

    def set_stream(self, handle: int, stream: int) -> None:
        self._check(self._lib.cublasSetStream_v2(handle, stream or None), "cublasSetStream")

    def gemm_ex(self, *args: Any) -> None:
        self._check(self._lib.cublasGemmEx(*args), "cublasGemmEx")

    def gemm_strided_batched_ex(self, *args: Any) -> None:
        self._check(self._lib.cublasGemmStridedBatchedEx(*args), "cublasGemmStridedBatchedEx")


@lru_cache(maxsize=1)
def cublas() -> Cublas | None:
    """The ctypes cuBLAS calls for CuPy's CUDA major version (None where not found)."""
    import cupy as cp

    major = int(cp.cuda.runtime.runtimeGetVersion()) // 1000
    for name in (f"libcublas.so.{major}", "libcublas.so"):
        try:
            return Cublas(ctypes.CDLL(name))
        except (OSError, AttributeError):
            continue
    log.info("cuBLAS not reachable through ctypes: prefill graphs unavailable")
    return None
