"""Weight upload to the GPU through a ring of page-locked staging buffers.

A copy from pageable memory (the GGUF's mmap) is staged by the driver through its own small
pinned buffer and returns only once the source is consumed, so uploading tensor by tensor with
``cp.asarray`` runs the page-cache reads and the PCIe transfers one after the other at a fraction
of either's speed. `Uploader` instead packs the tensors' bytes one after the other, across tensor
boundaries, into `SLOTS` page-locked buffers of `SLOT_BYTES`; host threads fill them in jobs of
at least `JOB_BYTES` (with `source`, the tensor's place in its file, each thread reads its part
with ``preadv`` straight into the buffer, provided the path still names the file the array maps
(`file_identity`) and the read succeeds; else it copies from the array: NumPy's copy and the read
both release the GIL), and once a tensor's jobs are done its asynchronous host-to-device
copies are queued on the caller's stream, so the transfer of one tensor overlaps the host copy of
the next. Measured on the H200 host (Qwen3-4B shape, 2,375 MiB in 253 matrices, warm page
cache, bench/results/upload-20261204/probe.md): the former one-thread copy from the mmap per
tensor took 331-338 ms, these 8 threads reading the file 261-270 ms. The rest is per tensor
(allocations, waits), not bandwidth: 16 threads reading the whole file in 64 MiB pieces took
85 ms. A buffer is reused once the event recorded after its last transfer has passed;
`finish()` waits for the last transfer and frees the buffers and threads (one sync).

Deferred uploads (`upload(..., defer=True)`, with `source`; what the CuPy backend does for every
matrix of a model file) remove that per-tensor wait: the array is allocated at once and its
bytes are read by `finish()`, for all deferred arrays together (`_read_deferred`: pieces of a
share of the ring dealt round-robin to the threads, each reading into one of its own two
buffers and queueing the transfer on its own stream while it reads the next). Measured the same
way: the 4B's weights 0.13-0.14 s instead of 0.32-0.40 s (bench/results/warm_start-20261204-s33/).
Nothing may read a deferred array before `finish()`.

Device memory: each tensor's array is allocated exactly as ``cp.asarray`` would (same size, the
same pool, the same order), or into the `out` array given; the staging buffers are host memory.

    up = Uploader()
    w = up.upload(host_array)      # a device array; its bytes may still be in flight
    v = up.upload(mapped, source=("model.gguf", offset, identity))   # the same bytes, from the file
    ...                            # later work on the same stream sees them
    d = up.upload(mapped, source=(...), defer=True)   # allocated; filled by finish()
    up.finish()                    # deferred arrays read, all transfers done, staging buffers freed
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import cupy as cp
import numpy as np

from ..gguf_file import stat_identity

SLOTS = 4
"""Page-locked staging buffers in the ring."""
SLOT_BYTES = 16 << 20
"""Size of each (the largest piece one transfer carries). Page-locking is paid per byte (H200
host: 20 ms to allocate and 5 ms to free 64 MiB, 5 and 1.4 ms for 16 MiB), and the transfers
(51 GB/s) stay well ahead of the host copies."""
JOB_BYTES = 1 << 20
"""The least one host thread copies in one job: a tensor's copy is split into one job per thread,
each at least this long (fewer, longer jobs for small tensors: a job costs ~15 us of Python)."""
MAX_WORKERS = 8
"""Host copy threads at most (default: one per CPU the process may use, up to this). H200 host,
the 4B shape's 253 matrices read from the file: 4 or 8 threads 250-270 ms, 16 threads 333 ms."""


def default_workers() -> int:
    """Copy threads for this machine: one per CPU the process may use, at most `MAX_WORKERS`."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, n))


class Uploader:
    """Host arrays to device arrays through `SLOTS` page-locked buffers (see the module)."""

    def __init__(
        self,
        slots: int = SLOTS,
        slot_bytes: int = SLOT_BYTES,
        workers: int | None = None,
        job_bytes: int = JOB_BYTES,
    ) -> None:
        self.slot_bytes = slot_bytes
        self.job_bytes = max(1, job_bytes)
        self._nslots = slots
        self._workers = default_workers() if workers is None else max(1, workers)
        self._bufs: list[np.ndarray] = []  # made on first use
        self._mems: list[Any] = []
        self._events: list[Any] = []  # per buffer: the event after its last transfer, or None
        self._streams: list[int] = []  # the stream that event was recorded on
        self._slot = -1  # the buffer being filled (-1: none yet)
        self._used = 0  # its bytes taken
        self._pieces: list[tuple[int, int, int, int]] = []  # staged, not sent: (slot, offset, device address, bytes)
        self._jobs: list[Any] = []  # their host copies
        self._pool: ThreadPoolExecutor | None = None
        self._deferred: list[tuple[np.ndarray, tuple[str, int, tuple[int, int, int, int]], cp.ndarray]] = []
        """Uploads read at `finish` (`upload(defer=True)`): (host bytes, source, the array: kept
        alive until it is filled, so its memory cannot be handed to another array meanwhile)."""
        self._failed: BaseException | None = None
        """Why reading the deferred uploads failed (their arrays hold no data; `finish` raises it again)."""

    @property
    def deferred(self) -> bool:
        """Whether arrays of deferred uploads are not filled yet (waiting for `finish`, or their
        reading failed: `finish` then raises why, every time)."""
        return bool(self._deferred) or self._failed is not None

    def upload(
        self,
        host: np.ndarray,
        source: tuple[str, int, tuple[int, int, int, int]] | None = None,
        out: cp.ndarray | None = None,
        defer: bool = False,
    ) -> cp.ndarray:
        """A device array equal to `host` (same dtype and shape); its bytes arrive in stream order.
        `source`: (file, byte offset, `file_identity`) where `host`'s bytes lie: read from there
        while the path still names that file (else, and where a read fails, copied from `host`).
        `out`: a C-contiguous device array of `host`'s size to fill (returned), else a new one.
        `defer` (with `source`): the array is allocated now and filled by `finish`, which reads
        every deferred upload at once by the copy threads (`_read_deferred`); nothing may read
        it before."""
        host = np.ascontiguousarray(host)
        if out is None:
            out = cp.empty(host.shape, dtype=host.dtype)
        elif out.nbytes != host.nbytes or not out.flags.c_contiguous:
            raise ValueError(
                f"out: {out.nbytes} bytes, C-contiguous {out.flags.c_contiguous}; host: {host.nbytes} bytes"
            )
        if defer and source is not None and host.size:
            self._deferred.append((host.reshape(-1).view(np.uint8), source, out))
            return out
        src = host.reshape(-1).view(np.uint8)
        fd = _open_same(source) if source is not None and src.size else -1
        try:
            base = int(out.data.ptr)
            a = 0
            while a < src.size:
                if self._slot < 0 or self._used == self.slot_bytes:
                    self._advance()
                n = min(src.size - a, self.slot_bytes - self._used)
                self._pieces.append((self._slot, self._used, base + a, n))
                dst = self._bufs[self._slot][self._used : self._used + n]
                self._used += n
                self._jobs += self._copy(dst, src[a : a + n], fd, source[1] + a if source is not None else 0)
                a += n
            self._send()
        except BaseException:
            self._drop_staged()  # nothing of this array is sent later (its memory goes back to the pool)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        return out

    def finish(self) -> None:
        """Read the deferred uploads, wait for every transfer, then free the staging buffers and
        the copy threads."""
        try:
            self._drop_staged()
            self._read_deferred()
            for ev in self._events:
                if ev is not None:
                    ev.synchronize()
        finally:
            self._events.clear()
            self._streams.clear()
            self._bufs.clear()
            self._mems.clear()
            self._slot, self._used = -1, 0
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None

    # ------------------------------------------------------------------------------------
    def _read_deferred(self) -> None:
        """Fill the deferred uploads' arrays: their bytes cut into pieces of a share of the ring
        (`SLOTS` x `SLOT_BYTES`, two buffers a thread), dealt round-robin to the copy threads in
        upload order (file order for a model), each thread reading a piece into one of its two
        buffers and queueing its transfer on a stream of its own while it reads the next; each
        thread waits for its last transfers, so the arrays are filled on return. A thread takes
        the GIL a few times a piece and never waits for another, so the load's other threads (the
        daemon's imports) no longer stall each tensor's last read, as a per-tensor wait for its
        jobs did."""
        if self._failed is not None:
            raise self._failed
        segs, self._deferred = self._deferred, []
        if not segs:
            return
        try:
            self._read(segs)
        except BaseException as exc:
            self._failed = exc
            raise

    def _read(self, segs: list[tuple[np.ndarray, tuple[str, int, tuple[int, int, int, int]], cp.ndarray]]) -> None:
        """`_read_deferred`'s work on `segs`."""
        for ev in self._events:  # the ring's memory is reused here: its transfers must be done
            if ev is not None:
                ev.synchronize()
        self._events = [None] * len(self._events)
        while len(self._bufs) < self._nslots:
            self._add_slot()
        per_slot = min(self.slot_bytes, -(-2 * self._workers // self._nslots))
        piece = self.slot_bytes // per_slot
        areas = [b[j * piece : (j + 1) * piece] for b in self._bufs for j in range(per_slot)]
        cuts = [(k, a, min(piece, s.size - a)) for k, (s, _, _) in enumerate(segs) for a in range(0, s.size, piece)]
        nbuf = 2 if len(areas) >= 2 else 1  # two buffers a thread (one where the ring is tinier)
        workers = max(1, min(self._workers, len(cuts), len(areas) // nbuf))
        fds: dict[tuple[str, tuple[int, ...]], int] = {}
        device = cp.cuda.Device().id
        # the arrays' memory may have been another array's, still read by work queued before: the
        # threads' streams start after it
        queued = cp.cuda.Event(disable_timing=True)
        queued.record(cp.cuda.get_current_stream())

        def run(w: int) -> None:
            with cp.cuda.Device(device):
                stream = cp.cuda.Stream(non_blocking=True)
                stream.wait_event(queued)
                mine = areas[nbuf * w : nbuf * w + nbuf]
                events: list[Any] = [None] * nbuf
                try:
                    for i, c in enumerate(range(w, len(cuts), workers)):
                        k, a, n = cuts[c]
                        src, source, arr = segs[k]
                        if events[i % nbuf] is not None:
                            events[i % nbuf].synchronize()  # the transfer out of this buffer has left it
                        dst = mine[i % nbuf][:n]
                        _fill(dst, src[a : a + n], fds[(source[0], tuple(source[2]))], source[1] + a)
                        cp.cuda.runtime.memcpyAsync(
                            int(arr.data.ptr) + a, dst.ctypes.data, n, cp.cuda.runtime.memcpyHostToDevice, stream.ptr
                        )
                        ev = cp.cuda.Event(disable_timing=True)
                        ev.record(stream)
                        events[i % nbuf] = ev
                finally:  # done (or failed): its transfers have left the ring before it is reused or freed
                    for ev in events:
                        if ev is not None:
                            ev.synchronize()

        try:
            for _, source, _ in segs:
                key = (source[0], tuple(source[2]))
                if key not in fds:
                    fds[key] = _open_same(source)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="weight-upload")
            done = [self._pool.submit(run, w) for w in range(workers)]
            try:
                errors = [f.exception() for f in done]  # waits for every thread, failed or not
            finally:  # interrupted (Ctrl-C): no descriptor is closed under a thread still reading it
                for f in done:
                    f.cancel()
                wait(done)
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
        finally:
            for fd in fds.values():
                if fd >= 0:
                    os.close(fd)

    def _add_slot(self) -> None:
        """One more page-locked buffer of the ring (no transfer out of it yet)."""
        mem = cp.cuda.PinnedMemory(self.slot_bytes)
        self._mems.append(mem)
        self._bufs.append(np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, self.slot_bytes))
        self._events.append(None)
        self._streams.append(0)

    def _advance(self) -> None:
        """Move to the next buffer of the ring, once its previous transfers have left it (a tensor
        longer than the ring sends its staged pieces first)."""
        i = (self._slot + 1) % self._nslots
        if i == len(self._bufs):
            self._add_slot()
        if any(p[0] == i for p in self._pieces):
            self._send()
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
            self._events[i] = None
        self._slot, self._used = i, 0

    def _copy(self, dst: np.ndarray, src: np.ndarray, fd: int, offset: int) -> list[Any]:
        """Fill `dst` (a staging buffer's range) with `src`'s bytes, read from `fd` at `offset`
        when `fd` >= 0: jobs for the threads, or inline when short."""
        n = src.size
        parts = min(self._workers, n // self.job_bytes)
        if parts < 2:
            _fill(dst, src, fd, offset)
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="weight-upload")
        step = -(-n // parts)
        return [
            self._pool.submit(_fill, dst[j : j + step], src[j : j + step], fd, offset + j) for j in range(0, n, step)
        ]

    def _send(self) -> None:
        """Once the staged host copies are done, queue their transfers and mark their buffers."""
        pieces, jobs = self._pieces, self._jobs
        for job in jobs:
            job.result()
        self._pieces, self._jobs = [], []
        stream = cp.cuda.get_current_stream()
        for slot, off, dst, n in pieces:
            ptr = self._bufs[slot].ctypes.data + off
            cp.cuda.runtime.memcpyAsync(dst, ptr, n, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            old = self._events[slot]
            if old is not None and self._streams[slot] != stream.ptr:
                stream.wait_event(old)  # the new event then covers the other stream's transfer too
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(stream)
            self._events[slot], self._streams[slot] = ev, stream.ptr

    def _drop_staged(self) -> None:
        """Forget what was staged and not sent, once its host copies have stopped writing."""
        for job in self._jobs:
            try:
                job.result()
            except BaseException:  # noqa: BLE001, S110 - the upload that staged it raised already
                pass
        self._pieces, self._jobs = [], []


def _open_same(source: tuple[str, int, tuple[int, int, int, int]]) -> int:
    """A descriptor of `source`'s file if the path still names the file of that identity, else -1."""
    try:
        fd = os.open(source[0], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return -1
    try:
        if stat_identity(os.fstat(fd)) == tuple(source[2]):
            return fd
    except OSError:
        pass
    os.close(fd)
    return -1


_PREADV = getattr(os, "preadv", None)  # missing on some platforms: the copy from the mapping then


def _fill(dst: np.ndarray, src: np.ndarray, fd: int, offset: int) -> None:
    """`dst[:] = src`, read from `fd` at `offset` when `fd` >= 0 (what a short or failed read
    leaves is copied from `src`)."""
    done = 0
    if fd >= 0 and _PREADV is not None:
        view = dst.data
        try:
            while done < dst.size:
                got = _PREADV(fd, [view[done:]], offset + done)
                if got <= 0:
                    break
                done += got
        except OSError:
            pass
    if done < dst.size:
        np.copyto(dst[done:], src[done:])
