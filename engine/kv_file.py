"""The KV rows of a token prefix as a file: keyed, checksummed, and read back only when everything
matches (`engine.prompt_cache` decides what is saved and when).

Layout (little-endian)::

    0   magic b"GENIEKV\\0"  format u32  header length u32  sha256 of the header [32]
    48  header: UTF-8 JSON {"key": {...}, "tokens": [...], "arrays": [...], "data_bytes": N}
        padding to a multiple of 64
        data: each array's rows [KV, n, D] C-contiguous, in the header's order

Every array of the model's KV cache (per layer K and V; an int8 layer's values and scales apart)
is listed by name, dtype, shape, offset in the data and CRC-32, and - in a file written from a
GPU's cache - its device checksum (`dsum`: `device_sums`, a sum mod 2^64 of a mix of every 16-bit
unit with its index, computed by one kernel launch per array). A file is used only when the
header's checksum holds, every field of its `CacheKey` equals the loaded model's, its token ids
are in the vocabulary and fit the context, its arrays are exactly the ones the model's cache has,
the file is exactly as long as the header says, and every array's checksum holds: on the host the
CRC-32 while it is read; into a GPU's cache the device checksum of the rows once they are on the
device (the CRC-32 of 280 MB costs ~20 ms of eight threads; the device checksum well under one),
so nothing is trusted before every array checked out. Anything else is a `Rejected` with a short
reason. A file is written to a temporary name
in its directory, synced and renamed, so a reader sees a whole file or none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import struct
import tempfile
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import ModelFormatError
from .gguf_file import stat_identity
from .kv_cache import Int8Rows, KVCache

if TYPE_CHECKING:
    from . import Model

FORMAT = 1
"""Version of this file layout (part of every key)."""
MAGIC = b"GENIEKV\0"
_PRELUDE = struct.Struct("<8sII32s")
ALIGN = 64
MAX_HEADER = 64 << 20
"""Largest header read (a million token ids in JSON is ~8 MiB)."""
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"


class Rejected(Exception):
    """A cache file that is not used: `reason` is one word (``checksum``, ``key:model``, ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        """Short, for counters and log fields."""
        self.detail = detail
        """What was found."""
        super().__init__(f"{reason}: {detail}")


@dataclass(frozen=True)
class CacheKey:
    """Everything that decides a prefix's K/V rows: a file is restored only into a model whose
    key is equal in every field."""

    format: int
    """`FORMAT` of the file layout."""
    model: str
    """sha256 of the GGUF's metadata records as stored (tokenizer and template apart), tensor
    table, file size and the first and last 256 bytes of every tensor."""
    tokenizer: str
    """sha256 of the ``tokenizer.*`` metadata records (vocabulary, merges, types, special ids)."""
    template: str
    """sha256 of the chat template records."""
    kv_dtype: str
    """KV element type: f32, f16 or int8."""
    layout: str
    """Layers, KV heads, head sizes and the context the cache is sized for."""
    backend: str
    """Compute backend and the device it runs on (K/V rounding differs between them)."""
    engine: str
    """sha256 of the engine's sources and its tuning options (a kernel change rounds differently)."""

    def digest(self) -> str:
        """24 hex digits naming this key's directory."""
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:24]

    def first_difference(self, other: Any) -> str | None:
        """The first field (in declaration order) where `other` (a header's key dict) differs."""
        if not isinstance(other, dict):
            return "key"
        for f in dataclasses.fields(self):
            if other.get(f.name) != getattr(self, f.name):
                return f.name
        return None


@functools.lru_cache(maxsize=1)
def engine_digest() -> str:
    """sha256 of every source file of the engine package (any engine change makes new keys)."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".c", ".cu", ".cuh", ".h") and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _device(backend: str) -> str:
    if backend == "cupy":
        import cupy as cp

        dev = cp.cuda.Device()
        name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return f"{name} sm_{dev.compute_capability}"
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{platform.machine()} {cpu}".strip()


def cache_key(model: Model) -> CacheKey:
    """The key of a loaded model (blocking: reads the bytes of the GGUF's metadata records and a
    few bytes per tensor, where `model.gguf_index` says they lie; the header is not parsed again).
    Raises ModelFormatError when the file is no longer the one the model was loaded from."""
    idx = model.gguf_index
    h_model, h_tok, h_tpl = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    with open(idx.path, "rb") as fh:
        fd = fh.fileno()
        st = os.fstat(fd)
        if idx.identity != stat_identity(st):
            raise ModelFormatError(idx.path, "file", "changed on disk since the model was loaded")
        end = max((e for _, e in idx.spans.values()), default=0)
        head = memoryview(os.pread(fd, end, 0))
        if len(head) != end:
            raise ModelFormatError(idx.path, "file", f"is {st.st_size} bytes, the header needs {end}")
        for name in sorted(idx.spans):
            tok = name.startswith("tokenizer.")
            h = h_tpl if name.startswith("tokenizer.chat_template") else h_tok if tok else h_model
            start, stop = idx.spans[name]
            h.update(head[start:stop])  # the record as stored: key, value type and value
        h_model.update(str(st.st_size).encode())
        for name, type_name, shape, offset, nbytes in idx.tensors:
            h_model.update(f"{name}:{type_name}:{shape}".encode())
            n = min(256, nbytes)
            h_model.update(os.pread(fd, n, offset) + os.pread(fd, n, offset + nbytes - n))
    s, tf = model.spec, model.transformer
    opts = json.dumps(dataclasses.asdict(model.options), sort_keys=True, default=repr)
    return CacheKey(
        format=FORMAT,
        model=h_model.hexdigest(),
        tokenizer=h_tok.hexdigest(),
        template=h_tpl.hexdigest(),
        kv_dtype=tf.kv.dtype,
        layout=f"layers={s.n_layers} kv_heads={s.n_kv_heads} head_dim={s.head_dim}/{s.v_head_dim} n_ctx={tf.n_ctx}",
        backend=f"{model.backend} {_device(model.backend)}",
        engine=hashlib.sha256((engine_digest() + opts).encode()).hexdigest(),
    )


def kv_arrays(kv: KVCache) -> list[tuple[str, Any]]:
    """(name, array [KV, n_ctx, D]) of every array of the cache, in file order."""
    out: list[tuple[str, Any]] = []
    for kind, layers in (("k", kv.k), ("v", kv.v)):
        for i, a in enumerate(layers):
            if isinstance(a, Int8Rows):
                out += [(f"{kind}{i}.q", a.q), (f"{kind}{i}.d", a.d)]
            else:
                out.append((f"{kind}{i}", a))
    return out


def _pitches(a: Any, n: int) -> tuple[int, int]:
    """(bytes of positions 0..n-1 of one head, bytes of one head's whole rows) of a C-contiguous
    [KV, n_ctx, D] array: the width and pitch of a 2-D copy of positions 0..n-1 of every head."""
    row = int(a.shape[2]) * int(a.dtype.itemsize)
    return n * row, int(a.shape[1]) * row


def rows_to_host(a: Any, n: int) -> np.ndarray:
    """Positions 0..n-1 of one array [KV, n_ctx, D] as a new host array [KV, n, D] (a device
    array in one 2-D copy: no device allocation)."""
    out = np.empty((a.shape[0], n, a.shape[2]), dtype=np.dtype(str(a.dtype)))
    if isinstance(a, np.ndarray):
        out[...] = a[:, :n, :]
        return out
    import cupy as cp

    width, pitch = _pitches(a, n)
    rt = cp.cuda.runtime
    rt.memcpy2D(out.ctypes.data, width, a.data.ptr, pitch, width, a.shape[0], rt.memcpyDeviceToHost)
    return out


def host_buffers(a: Any) -> Callable[[int], np.ndarray]:
    """How `read_arrays` gets a buffer of n bytes for arrays going into `a`'s device: plain host
    memory for a NumPy cache, page-locked memory (CuPy's pinned pool, reused) for a device one.
    The pinned pool is reached through `cupy.cuda`, not `cupyx.empty_pinned`: importing `cupyx`
    imports SciPy's sparse modules, 0.55 s that the first restore after a restart paid (H200)."""
    if isinstance(a, np.ndarray):
        return lambda n: np.empty(n, dtype=np.uint8)
    import cupy as cp

    return lambda n: np.ndarray((n,), dtype=np.uint8, buffer=cp.cuda.alloc_pinned_memory(n))


def rows_from_host(a: Any, host: np.ndarray, wait: bool = True) -> Any:
    """Write host rows [KV, n, D] into positions 0..n-1 of `a` in place (buffers keep their
    addresses, so captured CUDA graphs stay valid); a device array in one 2-D copy, finished when
    this returns (the host buffer may be reused) - or, with `wait` False, queued on the current
    stream: returns an event that passes once `host` has been read (None for a host array)."""
    n = host.shape[1]
    if isinstance(a, np.ndarray):
        a[:, :n, :] = host
        return None
    import cupy as cp

    host = np.ascontiguousarray(host)
    width, pitch = _pitches(a, n)
    stream, rt = cp.cuda.get_current_stream(), cp.cuda.runtime
    rt.memcpy2DAsync(a.data.ptr, pitch, host.ctypes.data, width, width, a.shape[0], rt.memcpyHostToDevice, stream.ptr)
    if wait:
        stream.synchronize()
        return None
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(stream)
    return ev


_MASK = (1 << 64) - 1
_SUM_K = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # the kernel `kv_sum16`'s constants


def device_sums(arrays: list[tuple[str, Any]], n: int) -> dict[str, int]:
    """The device checksum of positions 0..n-1 of each device array [KV, n_ctx, D] (name ->
    value): one `kv_sum16` launch per array on the current stream, one read back."""
    import cupy as cp

    from .kernels import kernel

    out = cp.zeros(len(arrays), dtype=cp.uint64)
    for slot, (_, a) in enumerate(arrays):
        width, pitch = _pitches(a, n)
        assert width % 2 == 0 and pitch % 2 == 0  # head rows hold whole 16-bit units (D % 32 == 0)
        units = int(a.shape[0]) * width // 2
        blocks = max(1, min(1024, -(-units // 256)))
        kernel("kv_sum16")(
            (blocks,), (256,), (a, np.int64(pitch // 2), np.int64(width // 2), np.int64(units), out, np.int32(slot))
        )
    return {name: int(v) for (name, _), v in zip(arrays, cp.asnumpy(out).tolist(), strict=True)}


def host_sum(rows: np.ndarray) -> int:
    """`device_sums`' value of host rows [KV, n, D] (its twin, in NumPy: the tests' reference)."""
    units = np.ascontiguousarray(rows).reshape(-1).view(np.uint8).view("<u2")
    k1, k2, k3 = (np.uint64(k) for k in _SUM_K)
    acc, step = 0, 1 << 22
    for lo in range(0, units.size, step):
        x = units[lo : lo + step].astype(np.uint64) + np.arange(lo, min(lo + step, units.size), dtype=np.uint64) * k1
        x *= k2
        x ^= x >> np.uint64(31)
        x *= k3
        x ^= x >> np.uint64(29)
        acc = (acc + int(x.sum(dtype=np.uint64))) & _MASK
    return acc


@dataclass(frozen=True)
class ArraySpec:
    """One array of a file: where its bytes are and what they must hash to."""

    name: str
    dtype: str
    shape: tuple[int, int, int]
    offset: int
    """From the start of the data section."""
    crc32: int
    dsum: int | None = None
    """The device checksum (`device_sums`) where the file was written from a GPU's cache."""

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * self.shape[0] * self.shape[1] * self.shape[2])


@dataclass(frozen=True)
class Header:
    """A file's checked header."""

    path: str
    tokens: tuple[int, ...]
    arrays: tuple[ArraySpec, ...]
    data_start: int
    size: int
    """File size in bytes."""


def tokens_name(tokens: Sequence[int]) -> str:
    """The file name of a prefix: sha256 of its token ids (int32)."""
    return hashlib.sha256(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:32] + SUFFIX


def write(
    directory: Path,
    key: CacheKey,
    tokens: Sequence[int],
    arrays: list[tuple[str, np.ndarray]],
    sums: dict[str, int] | None = None,
) -> Path:
    """Write one file atomically (temporary name, fsync, rename); returns its path. `sums`: the
    arrays' device checksums (`device_sums` of the device rows they were copied from), if any."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    specs: list[dict[str, Any]] = []
    offset = 0
    for name, a in arrays:
        a = np.ascontiguousarray(a)
        specs.append({"name": name, "dtype": str(a.dtype), "shape": list(a.shape), "offset": offset})
        specs[-1]["crc32"] = zlib.crc32(a.data.cast("B"))
        if sums is not None:
            specs[-1]["dsum"] = int(sums[name])
        offset += a.nbytes
    body = {"key": dataclasses.asdict(key), "tokens": [int(t) for t in tokens], "arrays": specs, "data_bytes": offset}
    header = json.dumps(body, separators=(",", ":")).encode()
    prelude = _PRELUDE.pack(MAGIC, FORMAT, len(header), hashlib.sha256(header).digest())
    start = -(-(_PRELUDE.size + len(header)) // ALIGN) * ALIGN
    final = directory / tokens_name(tokens)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(prelude + header + b"\0" * (start - _PRELUDE.size - len(header)))
            for _, a in arrays:
                fh.write(np.ascontiguousarray(a).data.cast("B"))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return final


def _shape3(x: Any) -> tuple[int, int, int]:
    a, b, c = (int(v) for v in x)
    return a, b, c


def read_header(path: str | os.PathLike[str], key: CacheKey, expect: list[tuple[str, Any]], n_vocab: int) -> Header:
    """Open and check a file's header against the model (`key`, its cache's arrays `expect`);
    raises Rejected (FileNotFoundError when it is gone). The arrays' bytes are checked later: by
    their CRC-32 while they are read (`read_arrays`), or into a GPU's cache by their device
    checksums once copied (`device_sums`)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            pre = fh.read(_PRELUDE.size)
            if len(pre) < _PRELUDE.size:
                raise Rejected("truncated", f"{size} bytes, shorter than the prelude")
            magic, fmt, hlen, digest = _PRELUDE.unpack(pre)
            if magic != MAGIC:
                raise Rejected("magic", f"not a prompt cache file ({magic!r})")
            if fmt != FORMAT:
                raise Rejected("format", f"format {fmt}, this engine reads {FORMAT}")
            if hlen > MAX_HEADER:
                raise Rejected("header", f"header of {hlen} bytes")
            raw = fh.read(hlen)
    except FileNotFoundError:
        raise  # gone (another process trimmed its directory): nothing to refuse
    except OSError as exc:
        raise Rejected("unreadable", str(exc)) from None
    if len(raw) < hlen:
        raise Rejected("truncated", f"header cut at {len(raw)} of {hlen} bytes")
    if hashlib.sha256(raw).digest() != digest:
        raise Rejected("checksum", "header checksum does not match")
    try:
        body = json.loads(raw)
        diff = key.first_difference(body["key"])
        tokens = tuple(int(t) for t in body["tokens"])
        arrays = tuple(
            ArraySpec(
                str(a["name"]),
                str(a["dtype"]),
                _shape3(a["shape"]),
                int(a["offset"]),
                int(a["crc32"]),
                None if a.get("dsum") is None else int(a["dsum"]) & _MASK,
            )
            for a in body["arrays"]
        )
        data_bytes = int(body["data_bytes"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise Rejected("header", f"malformed header: {type(exc).__name__}") from None
    if diff is not None:
        raise Rejected(f"key:{diff}", f"made for another {diff}")
    n = len(tokens)
    if n < 1 or any(t < 0 or t >= n_vocab for t in tokens):
        raise Rejected("tokens", "token ids outside the vocabulary")
    want, offset = [], 0
    for name, a in expect:
        shape = (int(a.shape[0]), n, int(a.shape[2]))
        if n >= int(a.shape[1]):
            raise Rejected("tokens", f"{n} tokens do not fit the context of {a.shape[1]}")
        want.append((name, str(a.dtype), shape, offset))
        offset += int(np.dtype(str(a.dtype)).itemsize) * shape[0] * shape[1] * shape[2]
    if [(s.name, s.dtype, s.shape, s.offset) for s in arrays] != want or data_bytes != offset:
        raise Rejected("layout", "arrays differ from the model's KV cache")
    start = -(-(_PRELUDE.size + hlen) // ALIGN) * ALIGN
    if size != start + data_bytes:
        reason = "truncated" if size < start + data_bytes else "size"
        raise Rejected(reason, f"{size} bytes, the header says {start + data_bytes}")
    return Header(p, tokens, arrays, start, size)


def read_arrays(
    header: Header, pool: Executor, empty: Callable[[int], np.ndarray] | None = None, crc: bool = True
) -> Iterator[tuple[ArraySpec, np.ndarray]]:
    """Each array of a checked header, read and CRC-checked in `pool` (a few ahead, in order) into
    buffers from `empty(nbytes)` (default: host memory; see `host_buffers`); raises Rejected on a
    checksum or read failure. `crc` False: not CRC-checked (the caller checks the device checksum
    of what it copied, `device_sums`, before trusting any of it)."""
    new = empty or (lambda n: np.empty(n, dtype=np.uint8))
    try:
        fd = os.open(header.path, os.O_RDONLY)
    except OSError as exc:
        raise Rejected("unreadable", str(exc)) from None

    def one(spec: ArraySpec) -> np.ndarray:
        buf = new(spec.nbytes)
        view, pos, done = buf.data, header.data_start + spec.offset, 0
        while done < spec.nbytes:
            got = os.preadv(fd, [view[done:]], pos + done)
            if got <= 0:
                raise Rejected("truncated", f"{spec.name} ends early")
            done += got
        if crc and zlib.crc32(view) != spec.crc32:
            raise Rejected("checksum", f"{spec.name} does not match its checksum")
        return buf.view(np.dtype(spec.dtype)).reshape(spec.shape)

    ahead = 2 * max(1, getattr(pool, "_max_workers", 1))
    pending: deque[tuple[ArraySpec, Future[np.ndarray]]] = deque()
    todo = iter(header.arrays)

    def fill() -> None:
        while len(pending) < ahead:
            spec = next(todo, None)
            if spec is None:
                return
            pending.append((spec, pool.submit(one, spec)))

    try:
        fill()
        while pending:
            spec, fut = pending.popleft()
            try:
                arr = fut.result()
            except OSError as exc:
                raise Rejected("unreadable", str(exc)) from None
            fill()
            yield spec, arr
    finally:
        for _, fut in pending:  # none may still read from the descriptor once it is closed
            if not fut.cancel():
                wait([fut])
        os.close(fd)
