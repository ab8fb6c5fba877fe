"""The CuPy backend's weight upload through page-locked staging buffers: what arrives on the device
is the host's bytes, whatever the size, the number of pieces and the reuse of the ring.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

from engine.backends.cupy_upload import Uploader  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_uploads_arrive_intact_through_a_small_ring() -> None:
    """Arrays larger than a staging buffer, empty ones and more arrays than buffers all arrive
    byte for byte, in their dtype and shape, once `finish` returns (and again after it)."""
    rng = np.random.default_rng(7)
    up = Uploader(slots=2, slot_bytes=1 << 20, workers=3)
    hosts = [
        rng.integers(0, 256, size=(300, 9000), dtype=np.uint8),  # 2.6 MiB: three pieces
        rng.standard_normal(5).astype(np.float32),
        np.zeros((0, 4), dtype=np.uint8),
        rng.integers(0, 256, size=(8 << 20) + 3, dtype=np.uint8),  # split over the copy threads
        *(rng.standard_normal(1000).astype(np.float32) for _ in range(5)),
    ]
    devs = [up.upload(h) for h in hosts]
    up.finish()
    for h, d in zip(hosts, devs, strict=True):
        assert d.dtype == h.dtype and d.shape == h.shape
        assert np.array_equal(cp.asnumpy(d), h)
    again = up.upload(hosts[0][::-1])  # non-contiguous source, after finish
    up.finish()
    assert np.array_equal(cp.asnumpy(again), hosts[0][::-1])
