"""Backends supply the ops of the forward pass: `numpy` (reference, CPU) and `cupy` (CUDA)."""

from __future__ import annotations


def cuda_available() -> tuple[bool, str]:
    """Whether a CUDA device is usable through CuPy, and why not when it isn't."""
    try:
        import cupy  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or a CUDA library load failure
        return False, f"cupy not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no CUDA device ({exc})"
    if n < 1:
        return False, "no CUDA device"
    return True, f"{n} CUDA device(s)"


def resolve_backend(name: str) -> str:
    """Map `auto` to `cupy` when CUDA works, else `numpy`; validate explicit names."""
    if name not in ("auto", "numpy", "cupy"):
        raise ValueError(f"unknown backend {name!r} (auto, numpy or cupy)")
    if name != "auto":
        return name
    ok, _ = cuda_available()
    try:
        import engine.backends.cupy_backend  # noqa: F401
    except ImportError:
        ok = False
    return "cupy" if ok else "numpy"
