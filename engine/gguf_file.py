"""Open a GGUF file: metadata as plain Python values, tensors memory-mapped (never copied here).

The format's constants (value types, ggml tensor types and their block sizes) are written out
below as the `gguf` package defines them (`tests/test_synth_models.py` checks they agree): importing
that package costs ~30 ms (its metadata, vocabulary and writer modules, PyYAML), and a daemon's
start waits for the engine's imports. Its `GGUFReader` builds a Python object per array element,
which takes ~10 s on Gemma's 262k-token vocabulary, so the header is walked here with `struct` and
`numpy.frombuffer` instead.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from . import strings_cache
from .errors import ModelFormatError, cap_text


class GGUFValueType(IntEnum):
    """Metadata value types (gguf's `GGUFValueType`)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
"""ggml tensor type id -> (name, values a block, bytes a block), as gguf's `GGML_QUANT_SIZES`."""

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4
"""ggml's GGML_MAX_DIMS: a tensor with more dimensions is refused."""
MAX_ARRAY_DEPTH = 4
"""Deepest nesting of metadata arrays accepted (real files use 1)."""
MAX_KEY_BYTES = 65_535
"""Longest metadata key or tensor name (llama.cpp's own writer never comes close)."""

# Tensor types the engine can compute with (names as in ggml / gguf.GGMLQuantizationType).
SUPPORTED_TYPES = frozenset(["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])

_SCALAR = {
    GGUFValueType.UINT8: ("<B", np.uint8),
    GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16),
    GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32),
    GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32),
    GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64),
    GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}


_VIEWS: dict[str, tuple[np.dtype[Any], tuple[int, ...] | None]] = {
    "F32": (np.dtype(np.float32), ()),
    "F16": (np.dtype(np.float16), ()),
    "BF16": (np.dtype(np.uint16), ()),
}
"""Float types viewed with their element type in the logical shape; the rest as uint8 rows."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file, its bytes still memory-mapped."""

    name: str
    """GGUF tensor name, e.g. ``blk.0.attn_q.weight``."""
    type_name: str
    """ggml type name, e.g. ``Q4_K``."""
    shape: tuple[int, ...]
    """Logical shape, outermost first, e.g. ``(rows, cols)`` for a weight ``y = W @ x``."""
    raw: np.ndarray
    """Stored bytes: ``uint8[rows, bytes_per_row]`` for quantized types, typed array otherwise."""
    offset: int = 0
    """Byte offset of the tensor's data in the file."""
    file_identity: tuple[int, int, int, int] | None = None
    """`file_identity` of the file `raw` maps (None: not mapped from a file, or not known): a
    reader of the bytes at `offset` by path checks it is still that file."""

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)


@dataclass
class GGUFFile:
    """Metadata and tensors of one GGUF file."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    loadable: bool = True
    """False for a header read alone (`read_gguf(header_only=True)`): tensors have no bytes."""
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Byte range [start, end) of each metadata record (key, type and value) in the file."""
    identity: tuple[int, int, int, int] | None = None
    """(device, inode, size, mtime in ns) of the file when it was read (`file_identity`)."""

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFormatError(self.path, key, "required metadata key is missing")
        return self.metadata[key]

    def number(
        self, key: str, default: Any = None, *, integer: bool = True, lo: float = 0, hi: float = float(1 << 40)
    ) -> Any:
        """Metadata `key` as an int (or float) in [lo, hi]; a missing key gives `default` (None: required).

        A value of the wrong type or out of range is a ModelFormatError naming the key and the value.
        """
        if key not in self.metadata:
            if default is None:
                raise ModelFormatError(self.path, key, "required metadata key is missing")
            return default
        value = self.metadata[key]
        if isinstance(value, np.generic):
            value = value.item()
        ok_type = (
            isinstance(value, int) and not isinstance(value, bool)
            if integer
            else isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        if not ok_type:
            want = "an integer" if integer else "a number"
            raise ModelFormatError(self.path, key, f"expected {want}, found {cap_text(repr(value), 80)}")
        if not (lo <= value <= hi):  # also refuses NaN
            raise ModelFormatError(self.path, key, f"value {value} is outside [{lo:g}, {hi:g}]")
        return int(value) if integer else float(value)


class _Cursor:
    """Bounds-checked reader over the memory-mapped header."""

    def __init__(self, path: str, buf: np.ndarray) -> None:
        self.path = path
        self.buf = buf
        self.mv = memoryview(buf)  # type: ignore[arg-type]
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise ModelFormatError(self.path, what, f"file is truncated: needs byte {end}, file has {len(self.buf)}")
        out = self.mv[self.pos : end]
        self.pos = end
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.unpack("<Q", what)
        if limit is not None and n > limit:
            raise ModelFormatError(self.path, what, f"string of {n} bytes is longer than the limit of {limit}")
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")

    def strings(self, n: int, what: str) -> list[str]:
        """`n` strings in a row (a vocabulary: one tight loop, ~5x faster than `string` per item;
        a long array from the strings cache when it holds these bytes' parse: `strings_cache`)."""
        cache = strings_cache.active() if n >= strings_cache.MIN_STRINGS else None
        if cache is not None:
            start = self.pos
            hit = cache.lookup(self.path, self.mv, start, n)
            if hit is not None:
                self.pos = hit[1]
                return hit[0]
            out, self.pos = _parse_strings(self.path, self.mv, start, n, what)
            path = self.path
            cache.store(path, self.mv, start, self.pos, n, lambda b: _parse_strings(path, b, 0, n, what))
            return out
        out, self.pos = _parse_strings(self.path, self.mv, self.pos, n, what)
        return out

    def count(self, n: int, min_bytes: int, what: str) -> int:
        """`n` items of at least `min_bytes` each must fit in the rest of the file (no huge list is built)."""
        left = len(self.buf) - self.pos
        if n * min_bytes > left:
            raise ModelFormatError(
                self.path, what, f"count {n} cannot fit: {n} items of >= {min_bytes} bytes, {left} bytes left"
            )
        return n

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ModelFormatError(self.path, what, f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
            etype = self.unpack("<I", what)
            count = self.unpack("<Q", what)
            if etype == GGUFValueType.STRING:
                return self.strings(self.count(count, 8, what), what)
            if etype == GGUFValueType.ARRAY:
                return [self.value(GGUFValueType.ARRAY, what, depth + 1) for _ in range(self.count(count, 12, what))]
            if etype not in _SCALAR:
                raise ModelFormatError(self.path, what, f"unknown array element type {etype}")
            fmt, dtype = _SCALAR[GGUFValueType(etype)]
            raw = self.take(count * struct.calcsize(fmt), what)
            return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).copy()
        if vtype not in _SCALAR:
            raise ModelFormatError(self.path, what, f"unknown value type {vtype}")
        fmt, _ = _SCALAR[GGUFValueType(vtype)]
        return self.unpack(fmt, what)


def _parse_strings(path: str, buf: memoryview, pos: int, n: int, what: str) -> tuple[list[str], int]:
    """`n` GGUF strings (u64 length, UTF-8 bytes) from `buf` at `pos`, and the byte after them."""
    end = len(buf)
    out: list[str] = []
    unpack_from, append = struct.Struct("<Q").unpack_from, out.append
    for _ in range(n):
        if pos + 8 > end:
            raise ModelFormatError(path, what, f"file is truncated: needs byte {pos + 8}, file has {end}")
        k = unpack_from(buf, pos)[0]
        pos += 8
        if pos + k > end:
            raise ModelFormatError(path, what, f"file is truncated: needs byte {pos + k}, file has {end}")
        append(str(buf[pos : pos + k], "utf-8", "replace"))
        pos += k
    return out, pos


def read_gguf(path: str | os.PathLike[str], header_only: bool = False) -> GGUFFile:
    """Open `path`; raise ModelFormatError naming what is wrong when it is not a usable GGUF.

    `header_only`: metadata and tensor shapes and types alone, for planning (`TensorInfo.raw` is a
    zero-stride view of the right shape and dtype, so `nbytes` is right and no tensor byte of the
    file is ever read; a file cut after its header still opens)."""
    p = os.fspath(path)
    try:
        identity = file_identity(p)
        size = identity[2]
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelFormatError(p, "file", f"cannot open: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelFormatError(p, "magic", f"expected b'GGUF', found {magic!r}: not a GGUF file")
    buf = np.memmap(p, dtype=np.uint8, mode="r", shape=(size,))
    cur = _Cursor(p, buf)
    cur.take(4, "magic")
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise ModelFormatError(p, "version", f"GGUF version {version} is not supported (2 or 3)")
    n_tensors = cur.unpack("<Q", "tensor_count")
    n_kv = cur.unpack("<Q", "kv_count")
    metadata: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(cur.count(n_kv, 13, "kv_count")):  # key length 8 + type 4 + >= 1 byte of value
        start = cur.pos
        key = cur.string("metadata key", MAX_KEY_BYTES)
        if key in metadata:
            raise ModelFormatError(p, key, "duplicate metadata key")
        vtype = cur.unpack("<I", key)
        metadata[key] = cur.value(vtype, key)
        spans[key] = (start, cur.pos)
    infos = []
    names: set[str] = set()
    for _ in range(cur.count(n_tensors, 24, "tensor_count")):  # name length 8 + dims 4 + type 4 + offset 8
        name = cur.string("tensor name", MAX_KEY_BYTES)
        if name in names:
            raise ModelFormatError(p, name, "duplicate tensor name")
        names.add(name)
        n_dims = cur.unpack("<I", name)
        if n_dims > MAX_DIMS:
            raise ModelFormatError(p, name, f"{n_dims} dimensions (at most {MAX_DIMS})")
        dims = [cur.unpack("<Q", name) for _ in range(n_dims)]
        ttype = cur.unpack("<I", name)
        offset = cur.unpack("<Q", name)
        infos.append((name, dims, ttype, offset))
    align = metadata.get("general.alignment", 32)
    if (
        isinstance(align, (bool, np.ndarray, list, str, float))
        or not 0 < int(align) <= 1 << 20
        or int(align) & (int(align) - 1)
    ):
        raise ModelFormatError(
            p, "general.alignment", f"expected a power of two up to 1 MiB, found {cap_text(repr(align), 80)}"
        )
    align = int(align)
    data_start = (cur.pos + align - 1) // align * align
    tensors: dict[str, TensorInfo] = {}
    for name, dims, ttype, offset in infos:
        if ttype not in GGML_TYPES:
            raise ModelFormatError(p, name, f"unknown tensor type id {ttype}")
        type_name, block, type_size = GGML_TYPES[ttype]
        shape = tuple(int(d) for d in reversed(dims))  # ggml lists the fastest dimension first
        n_elems = math.prod(shape)  # Python ints: no int64 overflow that could make a huge tensor look small
        cols = shape[-1] if shape else 1
        if cols % block:
            raise ModelFormatError(p, name, f"row length {cols} is not a multiple of {block}")
        nbytes = n_elems // block * type_size
        start = data_start + int(offset)
        if not header_only and start + nbytes > size:
            raise ModelFormatError(p, name, f"file is truncated: tensor ends at byte {start + nbytes}, file has {size}")
        dtype, view = _VIEWS.get(type_name, (np.dtype(np.uint8), None))
        if view is None:  # block-quantized: bytes per row
            rows = n_elems // cols if cols else 0
            view = (rows, cols // block * type_size)
        else:
            view = shape
        if header_only:  # the right shape and nbytes, no file byte behind it
            arr: np.ndarray = np.broadcast_to(np.zeros(1, dtype), view)
        else:
            arr = buf[start : start + nbytes].view(dtype).reshape(view)
        tensors[name] = TensorInfo(name, type_name, shape, arr, start, None if header_only else identity)
    return GGUFFile(p, metadata, tensors, loadable=not header_only, spans=spans, identity=identity)


def file_identity(path: str) -> tuple[int, int, int, int]:
    """(device, inode, size, mtime in ns) of `path`: a file replaced or rewritten has another."""
    return stat_identity(os.stat(path))


def stat_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """`file_identity` of a stat result (e.g. `os.fstat` of a file already open)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class GGUFIndex:
    """Where a loaded model's metadata records and tensors lie in its file (no value of them):
    what `kv_file.cache_key` hashes, straight from the file's bytes, without parsing the header
    again (a 150k-token vocabulary is ~0.1 s of Python to parse)."""

    path: str
    identity: tuple[int, int, int, int] | None
    """The file's `file_identity` when it was read."""
    spans: dict[str, tuple[int, int]]
    """`GGUFFile.spans`."""
    tensors: tuple[tuple[str, str, tuple[int, ...], int, int], ...]
    """(name, ggml type name, shape, offset, bytes) of every tensor, by name."""

    @classmethod
    def of(cls, gf: GGUFFile) -> GGUFIndex:
        """The index of a read file."""
        tensors = tuple((t.name, t.type_name, t.shape, t.offset, t.nbytes) for _, t in sorted(gf.tensors.items()))
        return cls(gf.path, gf.identity, dict(gf.spans), tensors)
