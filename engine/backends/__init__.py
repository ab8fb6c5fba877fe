"""Backends supply the ops of the forward pass: `numpy` (reference, CPU), `native` (compiled
quantized GEMV on CPU, `cpu_native`) and `cupy` (CUDA)."""

from __future__ import annotations

from ..options import EngineOptions


def cuda_available() -> tuple[bool, str]:
    """Whether a CUDA device is usable through CuPy, and why not when it isn't."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library load failure
        return False, f"cupy not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA device ({exc})"
    if n < 1:
        return False, "no CUDA device"
    return True, f"{n} CUDA device(s)"


def native_available(extra_cflags: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Whether the native CPU kernels compile and load here with these extra compiler flags
    (built once, cached on disk)."""
    from .cpu_native import native_available as _available

    return _available(extra_cflags)


def resolve_backend(name: str, options: EngineOptions | None = None) -> str:
    """Map `auto` to `cupy` when CUDA works, else `native` when the C kernels build (with the
    options' compiler flags), else `numpy`; validate explicit names."""
    if name not in ("auto", "numpy", "native", "cupy"):
        raise ValueError(f"unknown backend {name!r} (auto, numpy, native or cupy)")
    if name != "auto":
        return name
    ok, _ = cuda_available()
    try:
        import engine.backends.cupy_backend  # noqa: F401
    except ImportError:
        ok = False
    if ok:
        return "cupy"
    cflags = options.native_cflags if options is not None else ()
    return "native" if native_available(cflags)[0] else "numpy"
