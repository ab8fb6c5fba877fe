"""The driver-API launch structures of `engine.backends.cupy_launch` (no GPU needed): their layout
matches CUDA's `CUlaunchAttribute` / `CUlaunchConfig`, and arguments marshal to the bytes a
kernel expects."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine.backends import cupy_launch
from engine.backends.cupy_launch import _arg, _Attr, _Config
from engine.options import EngineOptions


def test_launch_structures_have_the_driver_layout() -> None:
    """CUlaunchAttribute is 72 bytes (id, 4 padding, 64-byte value); CUlaunchConfig puts the
    stream at byte 32, the attribute pointer at 40 and the count at 48 (56 bytes in all)."""
    assert ctypes.sizeof(_Attr) == 72 and _Attr.value.offset == 8
    assert (_Config.hStream.offset, _Config.attrs.offset, _Config.numAttrs.offset) == (32, 40, 48)
    assert ctypes.sizeof(_Config) == 56


def test_scalar_arguments_keep_their_bytes() -> None:
    """NumPy scalars become buffers of their own size and bytes (int32 4, int64 and pointers 8)."""
    for v in (np.int32(-7), np.int64(1 << 40), np.float32(0.5), np.uint64(0)):
        b = _arg(v)
        assert ctypes.sizeof(b) == v.nbytes and bytes(b) == v.tobytes()


def test_other_arguments_are_refused() -> None:
    """A Python int (size unknown to the kernel) is a TypeError naming its type."""
    with pytest.raises(TypeError, match="int"):
        _arg(3)


def test_switched_off_by_options() -> None:
    """`EngineOptions(cupy_pdl=False)` (env GENIE_CUPY_PDL=0) turns programmatic dependent launch
    off before any CUDA call."""
    cupy_launch._pdl_library.cache_clear()
    try:
        assert cupy_launch.pdl_launcher(EngineOptions(cupy_pdl=False).cupy_pdl) is None
        assert cupy_launch._pdl_library.cache_info().misses == 0  # the device was never asked
    finally:
        cupy_launch._pdl_library.cache_clear()
