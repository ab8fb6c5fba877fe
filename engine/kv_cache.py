"""The KV cache: fixed arrays sized at load for the chosen context, never grown while decoding."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .spec import ModelSpec

KV_DTYPES = {"f32": ("float32", 4), "f16": ("float16", 2)}


def kv_bytes(spec: ModelSpec, n_ctx: int, dtype: str = "f32") -> int:
    """Bytes of K and V for every layer at `n_ctx` positions."""
    _, size = KV_DTYPES[dtype]
    per_pos = spec.n_kv_heads * (spec.head_dim + spec.v_head_dim) * size
    return spec.n_layers * n_ctx * per_pos


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
        np_dtype, _ = KV_DTYPES[dtype]
        k = [ops.zeros((spec.n_kv_heads, n_ctx, spec.head_dim), np_dtype) for _ in range(spec.n_layers)]
        v = [ops.zeros((spec.n_kv_heads, n_ctx, spec.v_head_dim), np_dtype) for _ in range(spec.n_layers)]
        return cls(n_ctx, dtype, k, v)

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v))

    def common_prefix(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` are already cached."""
        n = 0
        for a, b in zip(self.tokens, ids, strict=False):
            if a != b:
                break
            n += 1
        return n
