"""The prewarm's CUDA context made through the driver is the one CuPy then uses (a fresh process).

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import require_cuda

require_cuda()

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

CHILD = """
import ctypes
from engine.prewarm import driver_context

took = driver_context()
lib = ctypes.CDLL("libcuda.so.1")
dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
before = active.value
import cupy as cp
cp.cuda.runtime.free(0)
primary, current = ctypes.c_void_p(), ctypes.c_void_p()
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(primary), dev) == 0
assert lib.cuCtxGetCurrent(ctypes.byref(current)) == 0
print(took is not None, before, primary.value == current.value, int(cp.arange(3).sum()))
"""


def test_cupy_runs_in_the_context_the_driver_made_first() -> None:
    """A context made by `driver_context` before CuPy is imported is the device's primary context,
    active at once, and the one CuPy's runtime then makes current."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "1", "True", "3"]
