"""NumPy backend: the reference ops on CPU (weights dequantized once to float32 at load)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..gguf_file import TensorInfo
from ..kv_cache import kv_rows, kv_write
from ..quants import dequantize, dequantize_rows
from .ops import Ops

_GELU_C = math.sqrt(2.0 / math.pi)


class NumpyOps:
    """Every op the forward pass uses; arrays are float32 NumPy arrays."""

    name = "numpy"
    xp: Any = np
    batch_dependent = False
    """Every row's result is independent of the batch (see `Ops.batch_dependent`)."""
    prefill_chunk: int | None = None
    """No preference: the engine's default chunk."""
    prefill_graphs: Any = None
    """No prefill graphs on the CPU."""
    prefill_dtype = ""
    """Float32 everywhere: no tile precision to choose."""

    # --- abilities (the CPU has none of the device's) -----------------------------------------
    def make_decoder(self, transformer: Any) -> Any | None:
        """No separate one-token decoder: decode steps run the forward pass."""
        return None

    def mark(self) -> Any | None:
        """None: every op has finished when it returns."""
        return None

    def synchronize(self) -> None:
        """Nothing is queued on the CPU."""

    # --- weights -------------------------------------------------------------------------
    def weight(self, t: TensorInfo) -> np.ndarray:
        """A tensor as a float32 array of its logical shape (dequantized once)."""
        return dequantize(t.raw, t.type_name, t.shape)

    def concat_rows(self, parts: list[np.ndarray]) -> np.ndarray:
        """Stack weights along the output dimension (fused QKV, fused gate+up)."""
        return np.ascontiguousarray(np.concatenate(parts, axis=0))

    def weight_rows(self, ts: list[TensorInfo]) -> np.ndarray:
        """The tensors' weights stacked by rows."""
        return self.concat_rows([self.weight(t) for t in ts])

    def finish_uploads(self) -> None:
        """Nothing to finish: the weights are host arrays."""

    def embed_rows(self, table: TensorInfo | np.ndarray, ids: np.ndarray, cols: int) -> np.ndarray:
        """Rows of the embedding table: [T] ids -> [T, E]."""
        if isinstance(table, np.ndarray):
            return table[ids]
        return dequantize_rows(table.raw, table.type_name, ids, cols)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=np.dtype(dtype))

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    # --- math ----------------------------------------------------------------------------
    @staticmethod
    def act_quant(x: np.ndarray, kind: str | None) -> np.ndarray:
        """Round activations the way llama.cpp's CPU path does before a quantized dot product.

        ``q8_0``: blocks of 32, scale amax/127 (also Q8_1's values); ``q8_k``: blocks of 256,
        scale = (signed value of largest magnitude) / -127 (ggml). None leaves x unchanged.
        """
        if kind is None:
            return x
        qk = 32 if kind == "q8_0" else 256
        t, n = x.shape
        xb = x.reshape(t, n // qk, qk)
        if kind == "q8_0":
            d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127)
            inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
            q = np.round(xb * inv)
        else:
            idx = np.abs(xb).argmax(axis=-1)[..., None]
            mx = np.take_along_axis(xb, idx, axis=-1)
            iscale = np.divide(np.float32(-127), mx, out=np.zeros_like(mx), where=mx != 0)
            q = np.minimum(np.round(xb * iscale), 127)
            d = np.divide(1.0, iscale, out=np.zeros_like(iscale), where=iscale != 0)
        return (q * d).astype(np.float32).reshape(t, n)

    @classmethod
    def linear(cls, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, aq: str | None = None) -> np.ndarray:
        """[T, in] x [out, in] -> [T, out] (+ bias); `aq` rounds x as llama.cpp does (act_quant)."""
        x = cls.act_quant(x, aq)
        y = (w @ x[0])[None, :] if x.shape[0] == 1 else x @ w.T
        if b is not None:
            y += b
        return y

    @staticmethod
    def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm over the last axis, scaled by `w`."""
        ms = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
        return (x / np.sqrt(ms + eps)) * w

    @staticmethod
    def rope_tables(n_ctx: int, dim: int, base: float, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, [n_ctx, dim/2], for positions 0..n_ctx-1."""
        inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
        ang = np.outer(np.arange(n_ctx, dtype=np.float64) / scale, inv)
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def norm_rope(
        self, x: np.ndarray, w: np.ndarray | None, eps: float, cos: np.ndarray, sin: np.ndarray, style: str
    ) -> np.ndarray:
        """`rope(rms_norm(x, w, eps))` (no norm where `w` is None): the two ops in turn."""
        return self.rope(x if w is None else self.rms_norm(x, w, eps), cos, sin, style)

    @staticmethod
    def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
        """Rotate [T, heads, D] by per-position [T, d/2] tables; d <= D dims rotate."""
        half = cos.shape[-1]
        c, s = cos[:, None, :], sin[:, None, :]
        out = x.copy()
        if style == "neox":
            x0, x1 = x[..., :half], x[..., half : 2 * half]
            out[..., :half] = x0 * c - x1 * s
            out[..., half : 2 * half] = x0 * s + x1 * c
        else:
            x0, x1 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
            out[..., 0 : 2 * half : 2] = x0 * c - x1 * s
            out[..., 1 : 2 * half : 2] = x0 * s + x1 * c
        return out

    @staticmethod
    def kv_store(cache: Any, start: int, x: np.ndarray) -> None:
        """Write [T, KV, D] into the cache [KV, n_ctx, D] at positions start..start+T-1
        (rounded to int8 blocks for an int8 cache)."""
        kv_write(np, cache, start, x)

    @staticmethod
    def attention(
        q: np.ndarray,
        k_cache: Any,
        v_cache: Any,
        start: int,
        window: int,
        scale: float,
    ) -> np.ndarray:
        """Causal (optionally sliding-window) GQA attention of [T, H, D] queries at positions
        start.. over the cached keys 0..start+T-1 -> [T, H*Dv]."""
        t, h, d = q.shape
        kv = k_cache.shape[0]
        g = h // kv
        end = start + t
        lo = max(0, start - window + 1) if window else 0
        # float64 here makes each query row's result independent of how many rows are computed
        # together (BLAS blocking, masked zeros): prefill chunking, the prefix cache and
        # preemption then cannot change a greedy answer through llama.cpp-style rounding flips.
        k = kv_rows(np, k_cache, lo, end, np.float64)
        v = kv_rows(np, v_cache, lo, end, np.float64)
        qg = q.astype(np.float64).reshape(t, kv, g, d).transpose(1, 0, 2, 3).reshape(kv, t * g, d)
        scores = (qg @ k.transpose(0, 2, 1)) * scale  # [KV, T*G, S]
        scores = scores.reshape(kv, t, g, end - lo)
        if t > 1 or window:
            qpos = np.arange(start, end)[:, None]
            kpos = np.arange(lo, end)[None, :]
            masked = kpos > qpos
            if window:
                masked |= (qpos - kpos) >= window
            scores += np.where(masked, -np.inf, 0.0)[None, :, None, :]
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = (scores.reshape(kv, t * g, end - lo) @ v).astype(np.float32)  # [KV, T*G, Dv]
        dv = v.shape[-1]
        return out.reshape(kv, t, g, dv).transpose(1, 0, 2, 3).reshape(t, h * dv)

    @staticmethod
    def gated_act(gate: np.ndarray, up: np.ndarray, kind: str) -> np.ndarray:
        """SwiGLU (`silu`) or GeGLU with tanh GELU (`gelu_tanh`)."""
        if kind == "silu":
            return gate / (1.0 + np.exp(-gate)) * up
        inner = _GELU_C * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (1.0 + np.tanh(inner)) * up


_CHECKED: type[Ops] = NumpyOps
"""NumpyOps is an `Ops` (mypy checks it here)."""
