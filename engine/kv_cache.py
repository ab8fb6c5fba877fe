"""The KV cache: fixed arrays sized at load for the chosen context, never grown while decoding.

Element types: ``f32``, ``f16`` and ``int8``. An ``int8`` layer is `Int8Rows`: int8 values plus one
float16 scale per 32 values of a head row (llama.cpp's q8_0 blocks, values and scales kept in two
arrays so both stay aligned for vector loads). A row block is rounded as

    d = max|x| / 127;  q = rint(x / d)  (0 where d == 0);  stored scale = float16(d)

and read back as ``q * float32(scale)``; `quantize_rows` / `dequantize_rows` are that rule for
NumPy and CuPy arrays alike, and the CUDA decode kernels do the same float operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .spec import ModelSpec

KV_DTYPES = {"f32": ("float32", 4), "f16": ("float16", 2), "int8": ("int8", 1)}
QBLOCK = 32
"""Values per int8 scale."""


def kv_bytes(spec: ModelSpec, n_ctx: int, dtype: str = "f32") -> int:
    """Bytes of K and V for every layer at `n_ctx` positions (int8: values + float16 scales)."""
    _, size = KV_DTYPES[dtype]
    dims = spec.head_dim + spec.v_head_dim
    per_pos = spec.n_kv_heads * dims * size
    if dtype == "int8":
        per_pos += spec.n_kv_heads * (dims // QBLOCK) * 2
    return spec.n_layers * n_ctx * per_pos


def check_kv_dtype(spec: ModelSpec, dtype: str) -> None:
    """Raise ValueError when `dtype` cannot hold this model's heads."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    if dtype == "int8" and (spec.head_dim % QBLOCK or spec.v_head_dim % QBLOCK):
        raise ValueError(
            f"kv_dtype int8 needs head sizes that are multiples of {QBLOCK} "
            f"(this model: {spec.head_dim}/{spec.v_head_dim})"
        )


@dataclass
class Int8Rows:
    """One layer's K or V cache in int8: values `q` [KV, n_ctx, D] and float16 scales `d`
    [KV, n_ctx, D/32] (see the module doc for the rounding rule)."""

    q: Any
    d: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def dtype(self) -> Any:
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.d.nbytes)

    def store(self, xp: Any, start: int, x: Any) -> None:
        """Round [T, KV, D] float values into positions start..start+T-1."""
        q, d = quantize_rows(xp, x.transpose(1, 0, 2))
        self.q[:, start : start + x.shape[0], :] = q
        self.d[:, start : start + x.shape[0], :] = d

    def rows(self, xp: Any, lo: int, end: int, dtype: Any) -> Any:
        """Positions lo..end-1 as [KV, end - lo, D] in `dtype`."""
        return dequantize_rows(xp, self.q[:, lo:end, :], self.d[:, lo:end, :]).astype(dtype, copy=False)


def quantize_rows(xp: Any, x: Any) -> tuple[Any, Any]:
    """float [..., D] -> (int8 [..., D], float16 [..., D/32]) by the module doc's rule."""
    x = xp.asarray(x, dtype=xp.float32)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // QBLOCK, QBLOCK)
    d = xp.abs(blocks).max(axis=-1) / xp.float32(127.0)
    safe = xp.where(d > 0, d, xp.float32(1.0))
    q = xp.where(d[..., None] > 0, xp.rint(blocks / safe[..., None]), xp.float32(0.0))
    return q.astype(xp.int8).reshape(x.shape), d.astype(xp.float16)


def dequantize_rows(xp: Any, q: Any, d: Any) -> Any:
    """(int8 [..., D], float16 [..., D/32]) -> float32 [..., D]."""
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // QBLOCK, QBLOCK).astype(xp.float32)
    return (blocks * d.astype(xp.float32)[..., None]).reshape(q.shape)


def kv_rows(xp: Any, cache: Any, lo: int, end: int, dtype: Any) -> Any:
    """Positions lo..end-1 of one layer's K or V cache as [KV, end - lo, D] in `dtype`."""
    if isinstance(cache, Int8Rows):
        return cache.rows(xp, lo, end, dtype)
    return cache[:, lo:end, :].astype(dtype)


def kv_write(xp: Any, cache: Any, start: int, x: Any) -> None:
    """Write [T, KV, D] into one layer's cache at positions start..start+T-1."""
    if isinstance(cache, Int8Rows):
        cache.store(xp, start, x)
    else:
        cache[:, start : start + x.shape[0], :] = x.transpose(1, 0, 2)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class KVSnapshot:
    """Copies of a cache's first positions: what `KVCache.restore` puts back."""

    tokens: tuple[int, ...]
    """The token ids of the copied positions."""
    k: list[Any]
    """Per layer, K rows [KV, n, D] (or `Int8Rows`)."""
    v: list[Any]
    """Per layer, V rows [KV, n, Dv] (or `Int8Rows`)."""

    def common_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` the snapshot holds."""
        return common_prefix(self.tokens, ids)


@dataclass
class KVCache:
    """Per-layer K [KV, n_ctx, D] and V [KV, n_ctx, Dv] plus the tokens they hold."""

    n_ctx: int
    dtype: str
    k: list[Any]
    v: list[Any]
    tokens: list[int] = field(default_factory=list)
    """Token ids whose K/V are in the cache (positions 0..len-1); reused as a prefix cache."""

    @classmethod
    def allocate(cls, ops: Any, spec: ModelSpec, n_ctx: int, dtype: str = "f32") -> KVCache:
        check_kv_dtype(spec, dtype)
        np_dtype, _ = KV_DTYPES[dtype]

        def layer(dim: int) -> Any:
            if dtype == "int8":
                return Int8Rows(
                    ops.zeros((spec.n_kv_heads, n_ctx, dim), "int8"),
                    ops.zeros((spec.n_kv_heads, n_ctx, dim // QBLOCK), "float16"),
                )
            return ops.zeros((spec.n_kv_heads, n_ctx, dim), np_dtype)

        k = [layer(spec.head_dim) for _ in range(spec.n_layers)]
        v = [layer(spec.v_head_dim) for _ in range(spec.n_layers)]
        return cls(n_ctx, dtype, k, v)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v))

    def token_bytes(self) -> int:
        """Bytes one cached position takes over every layer's K and V."""
        return self.nbytes // max(1, self.n_ctx)

    def snapshot(self, n: int) -> KVSnapshot:
        """A copy of positions 0..n-1 (rows and token ids), on the cache's device."""
        n = max(0, min(n, len(self.tokens)))

        def rows(a: Any) -> Any:
            if isinstance(a, Int8Rows):
                return Int8Rows(a.q[:, :n, :].copy(), a.d[:, :n, :].copy())
            return a[:, :n, :].copy()

        return KVSnapshot(tuple(self.tokens[:n]), [rows(a) for a in self.k], [rows(a) for a in self.v])

    def restore(self, snap: KVSnapshot) -> None:
        """Put a snapshot's rows back at positions 0..len-1, in place (buffers keep their
        addresses: captured CUDA graphs stay valid); the cache then holds exactly its tokens."""
        n = len(snap.tokens)

        def put(a: Any, r: Any) -> None:
            if isinstance(a, Int8Rows):
                a.q[:, :n, :] = r.q
                a.d[:, :n, :] = r.d
            else:
                a[:, :n, :] = r

        for a, r in zip(self.k, snap.k, strict=True):
            put(a, r)
        for a, r in zip(self.v, snap.v, strict=True):
            put(a, r)
        self.tokens = list(snap.tokens)

    def common_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` are already cached."""
        return common_prefix(self.tokens, ids)
