"""The CuPy backend's weight upload through page-locked staging buffers: what arrives on the device
is the host's bytes, whatever the size, the number of pieces, their packing across arrays and
the reuse of the ring.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

from engine.backends.cupy_upload import Uploader  # noqa: E402
from engine.gguf_file import file_identity  # noqa: E402

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


def test_uploads_into_rows_of_a_given_array_and_refuse_a_wrong_one(tmp_path: Path) -> None:
    """`out` receives the host's bytes in its own rows (from memory and from the file), the rows
    around it are untouched, and an array of another size or a strided one is refused."""
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 256, size=(40, 3000), dtype=np.uint8), rng.integers(0, 256, size=(24, 3000), dtype=np.uint8)
    path = tmp_path / "b.bin"
    path.write_bytes(b"xyz" + b.tobytes())
    buf = cp.full((70, 3000), 7, dtype=cp.uint8)
    up = Uploader(slots=2, slot_bytes=1 << 16, workers=2)
    assert up.upload(a, out=buf[:40]).data.ptr == buf.data.ptr
    up.upload(b, (str(path), 3, file_identity(str(path))), out=buf[40:64])
    with pytest.raises(ValueError, match="bytes"):
        up.upload(a, out=buf[:39])
    with pytest.raises(ValueError, match="C-contiguous"):
        up.upload(np.zeros((40, 10), np.uint8), out=buf[:40, :10])
    up.finish()
    got = cp.asnumpy(buf)
    assert np.array_equal(got[:40], a) and np.array_equal(got[40:64], b) and (got[64:] == 7).all()


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_deferred_uploads_are_read_from_their_file_at_finish(tmp_path: Path, workers: int) -> None:
    """Deferred uploads (odd sizes, some longer than a piece, some into rows of one array) hold the
    file's bytes once `finish` returns, in any number of threads; one whose file was replaced
    since gets the mapped bytes; undeferred uploads beside them still arrive."""
    rng = np.random.default_rng(workers)
    sizes = [int(n) for n in rng.integers(1, 300_000, size=9)] + [700_001, 5]
    blob = rng.integers(0, 256, size=sum(sizes) + 7, dtype=np.uint8)
    path = tmp_path / "w.bin"
    path.write_bytes(blob.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    ident = file_identity(str(path))
    up = Uploader(slots=2, slot_bytes=1 << 18, workers=workers)
    offs = np.cumsum([7, *sizes[:-1]])
    devs = [
        up.upload(mapped[o : o + n], (str(path), int(o), ident), defer=True) for o, n in zip(offs, sizes, strict=True)
    ]
    stacked = cp.zeros(sizes[0] + sizes[1], dtype=cp.uint8)
    up.upload(
        mapped[offs[0] : offs[0] + sizes[0]], (str(path), int(offs[0]), ident), out=stacked[: sizes[0]], defer=True
    )
    up.upload(
        mapped[offs[1] : offs[1] + sizes[1]], (str(path), int(offs[1]), ident), out=stacked[sizes[0] :], defer=True
    )
    plain = rng.standard_normal(1000).astype(np.float32)
    undeferred = up.upload(plain)
    swapped = tmp_path / "swapped.bin"  # replaced between its upload and `finish`: the mapped bytes
    swapped.write_bytes(blob[:300].tobytes())
    old = np.memmap(swapped, dtype=np.uint8, mode="r")
    moved = up.upload(old, (str(swapped), 0, file_identity(str(swapped))), defer=True)
    (tmp_path / "new.bin").write_bytes(bytes(300))
    (tmp_path / "new.bin").replace(swapped)
    other = tmp_path / "other.bin"  # the same name, another file by the time it is read: the mapped bytes
    other.write_bytes(bytes(100))
    stale = up.upload(blob[:100], (str(other), 0, (0, 0, 0, 0)), defer=True)
    assert up.deferred
    up.finish()
    assert not up.deferred
    for o, n, d in zip(offs, sizes, devs, strict=True):
        assert np.array_equal(cp.asnumpy(d), blob[o : o + n])
    assert np.array_equal(cp.asnumpy(stacked), blob[offs[0] : offs[0] + sizes[0] + sizes[1]])
    assert np.array_equal(cp.asnumpy(undeferred), plain)
    assert np.array_equal(cp.asnumpy(stale), blob[:100])
    assert np.array_equal(cp.asnumpy(moved), blob[:300])


def test_small_arrays_share_a_buffer_and_later_work_sees_them_before_finish() -> None:
    """Arrays packed into one staging buffer across array boundaries, some copied by the threads
    and some inline, are on the device for work queued after their upload, before `finish`."""
    rng = np.random.default_rng(11)
    up = Uploader(slots=3, slot_bytes=1 << 20, workers=4, job_bytes=64 << 10)
    hosts = [rng.integers(0, 256, size=int(n), dtype=np.uint8) for n in rng.integers(1, 700_000, size=12)]
    devs = [up.upload(h) for h in hosts]
    joined = cp.concatenate(devs)  # same stream, no synchronisation of the host
    assert np.array_equal(cp.asnumpy(joined), np.concatenate(hosts))
    big = rng.integers(0, 256, size=(5 << 20) + 11, dtype=np.uint8)  # longer than the whole ring
    assert np.array_equal(cp.asnumpy(up.upload(big)), big)
    up.finish()


def test_arrays_read_from_their_file_arrive_intact_even_past_its_end(tmp_path: Path) -> None:
    """With `source` the bytes are read from the file (in thread jobs and inline); where the file
    ends early, the rest comes from the array, so the device always gets the array's bytes."""
    rng = np.random.default_rng(5)
    hosts = [rng.integers(0, 256, size=n, dtype=np.uint8) for n in (3 << 20, 100, 700_001, 2 << 20)]
    path = tmp_path / "weights.bin"
    offsets, blob = [], b"GGUF"
    for h in hosts:
        offsets.append(len(blob))
        blob += h.tobytes()
    path.write_bytes(blob[: len(blob) - 4096])  # the last array's tail is missing from the file
    on_disk = np.memmap(path, dtype=np.uint8, mode="r")
    up = Uploader(slots=2, slot_bytes=1 << 20, workers=4, job_bytes=128 << 10)
    ident = file_identity(str(path))
    devs = [up.upload(h, (str(path), o, ident)) for h, o in zip(hosts, offsets, strict=True)]
    up.finish()
    for h, d in zip(hosts, devs, strict=True):
        assert np.array_equal(cp.asnumpy(d), h)
    assert np.array_equal(cp.asnumpy(devs[0]), on_disk[offsets[0] : offsets[0] + hosts[0].size])


def test_a_file_replaced_at_its_path_is_not_read_and_a_failed_upload_leaves_no_state(tmp_path: Path) -> None:
    """When the path names another file than the identity given, the mapped array's bytes are
    used; an upload that raises stages nothing that a later upload would send."""
    path = tmp_path / "model.gguf"
    data = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")[1 << 20 : 3 << 20]
    ident = file_identity(str(path))
    fresh = tmp_path / "new.gguf"
    np.zeros(data.size, np.uint8).tofile(fresh)
    fresh.replace(path)  # the model updated on disk after its header was read
    up = Uploader(slots=2, slot_bytes=1 << 20, workers=4, job_bytes=1 << 18)
    dev = up.upload(np.ascontiguousarray(mapped), (str(path), 1 << 20, ident))
    assert np.array_equal(cp.asnumpy(dev), mapped)

    up.finish()


def test_an_upload_that_fails_midway_sends_nothing_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that raises after pieces were staged leaves nothing staged: memory the pool hands
    out again after the failed array is not written by a late transfer, and later uploads are whole."""
    import engine.backends.cupy_upload as cu

    up = Uploader(slots=3, slot_bytes=1 << 20, workers=1)
    real, calls = cu._fill, [0]

    def fail_third(*args: object) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(5, "simulated read error")
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cu, "_fill", fail_third)
    with pytest.raises(OSError):
        up.upload(np.full(3 << 20, 7, dtype=np.uint8))  # three pieces: the third one fails
    monkeypatch.setattr(cu, "_fill", real)
    reused = cp.zeros(3 << 20, dtype=np.uint8)  # likely the failed array's block
    small = np.arange(5000, dtype=np.uint16)
    assert np.array_equal(cp.asnumpy(up.upload(small)), small)
    up.finish()
    assert not bool((reused == 7).any())
