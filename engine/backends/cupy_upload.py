"""Weight upload to the GPU through a ring of page-locked staging buffers.

A copy from pageable memory (the GGUF's mmap) is staged by the driver through its own small
pinned buffer and returns only once the source is consumed, so uploading tensor by tensor with
``cp.asarray`` runs the page-cache reads and the PCIe transfers one after the other at a fraction
of either's speed. `Uploader` instead copies each tensor, in pieces of at most `SLOT_BYTES`,
into one of `SLOTS` page-locked buffers (host threads share the copy: the reads fault the mmap's
pages in, and NumPy's copy releases the GIL), then queues an asynchronous host-to-device copy from
that buffer on the caller's stream and moves to the next buffer, so the host copy of one piece
overlaps the transfer of the one before. A buffer is reused once the event recorded after its
transfer has passed; `finish()` waits for the last transfer and frees the buffers (one sync).

Device memory: each tensor's array is allocated exactly as ``cp.asarray`` would (same size, the
same pool, the same order); the staging buffers are host memory.

    up = Uploader()
    w = up.upload(host_array)      # a device array; its bytes may still be in flight
    ...                            # later work on the same stream sees them
    up.finish()                    # all transfers done, staging buffers freed
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cupy as cp
import numpy as np

SLOTS = 4
"""Page-locked staging buffers in the ring."""
SLOT_BYTES = 16 << 20
"""Size of each (the largest piece one transfer carries). Page-locking is paid per byte (H200
host: 20 ms to allocate and 5 ms to free 64 MiB, 5 and 1.4 ms for 16 MiB), and 16 MiB pieces keep
the transfers (51 GB/s) well ahead of the host copies: the Qwen3-4B shape's weights phase took
0.474 s with 4 x 16 MiB against 0.535 s with 4 x 64 MiB (same process, alternating; more copy
threads, or preadv into the buffers instead of copying from the mmap, changed nothing there)."""
COPY_WORKERS = 4
"""Host threads that share one piece's copy into its staging buffer."""
_SPLIT = 4 << 20  # a piece shorter than this is copied by the calling thread alone


class Uploader:
    """Host arrays to device arrays through `SLOTS` page-locked buffers (see the module)."""

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES, workers: int = COPY_WORKERS) -> None:
        self.slot_bytes = slot_bytes
        self._nslots = slots
        self._bufs: list[np.ndarray] = []  # made on first use
        self._mems: list[Any] = []
        self._events: list[Any] = []
        self._next = 0
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None

    def _slot(self) -> tuple[np.ndarray, Any]:
        """The next staging buffer, once its previous transfer has left it."""
        i = self._next
        self._next = (i + 1) % self._nslots
        if i == len(self._bufs):
            mem = cp.cuda.PinnedMemory(self.slot_bytes)
            self._mems.append(mem)
            self._bufs.append(np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, self.slot_bytes))
            self._events.append(None)
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
        return self._bufs[i], i

    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        n = src.size
        if n < 2 * _SPLIT or self._workers < 2:
            np.copyto(dst[:n], src)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="weight-upload")
        step = -(-n // self._workers)
        jobs = [
            self._pool.submit(np.copyto, dst[a : min(a + step, n)], src[a : min(a + step, n)])
            for a in range(0, n, step)
        ]
        for job in jobs:
            job.result()

    def upload(self, host: np.ndarray) -> cp.ndarray:
        """A device array equal to `host` (same dtype and shape); its bytes arrive in stream order."""
        host = np.ascontiguousarray(host)
        out = cp.empty(host.shape, dtype=host.dtype)
        src = host.reshape(-1).view(np.uint8)
        if src.size == 0:
            return out
        stream = cp.cuda.get_current_stream()
        base = int(out.data.ptr)
        for a in range(0, src.size, self.slot_bytes):
            piece = src[a : a + self.slot_bytes]
            buf, i = self._slot()
            self._copy(buf, piece)
            cp.cuda.runtime.memcpyAsync(
                base + a, buf.ctypes.data, piece.size, cp.cuda.runtime.memcpyHostToDevice, stream.ptr
            )
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(stream)
            self._events[i] = ev
        return out

    def finish(self) -> None:
        """Wait for every transfer, then free the staging buffers and the copy threads."""
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        self._events.clear()
        self._bufs.clear()
        self._mems.clear()
        self._next = 0
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
