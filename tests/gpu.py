"""The GPU test modules' shared start: CuPy imported and a usable CUDA device, else the whole
module is skipped (with why). Call `require_cuda()` at module level, before importing CuPy users."""

from __future__ import annotations

from typing import Any

import pytest


def require_cuda() -> Any:
    """The `cupy` module; skips the calling module where CuPy or a CUDA device is missing."""
    cp = pytest.importorskip("cupy")
    from engine.backends import cuda_available

    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"no usable CUDA device: {why}", allow_module_level=True)
    return cp
