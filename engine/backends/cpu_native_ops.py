"""The native backend's ops: GGUF-block weights and the compiled C kernels doing the math.

`QWeight` keeps a 2-D weight in its GGUF block layout (no float32 copy) and `QParts` a fused matrix
whose parts have different types. `NativeOps` loads the kernels through `cpu_native.load_library`
(with the options' extra compiler flags) and runs every projection as one quantization of the
activation row plus integer block dot products (`linear`), and RMSNorm, RoPE, attention over the fp16
cache and the gated activations with llama.cpp's arithmetic. It holds a `NumpyOps` and hands it what
the kernels do not take: float weights, other caches, the embedding lookup of float tables, the KV
writes and the CPU's (absent) device abilities.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..gguf_file import TensorInfo
from ..options import DEFAULT_OPTIONS, EngineOptions
from ..quants import dequantize_rows
from .cpu_native import ACT_KIND, GGML_TYPE, default_threads, limit_blas_threads, load_library
from .numpy_backend import NumpyOps
from .ops import Ops


class QWeight:
    """A 2-D weight kept in its GGUF block layout: ``raw`` is uint8 [rows, bytes per row]."""

    __slots__ = ("raw", "type_name", "ggml_type", "shape", "nbytes", "ptr", "kind")

    def __init__(self, raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> None:
        self.raw = np.ascontiguousarray(raw)
        self.type_name = type_name
        self.ggml_type = GGML_TYPE[type_name]
        self.kind = ACT_KIND[type_name]
        self.shape = (int(shape[0]), int(shape[1]))
        self.nbytes = int(self.raw.nbytes)
        self.ptr = int(self.raw.ctypes.data)

    def __repr__(self) -> str:
        return f"QWeight({self.type_name}, {self.shape})"


class QParts:
    """Weights fused along the output dimension whose parts have different types."""

    __slots__ = ("parts", "shape", "nbytes")

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.shape = (sum(int(p.shape[0]) for p in parts), int(parts[0].shape[1]))
        self.nbytes = int(sum(p.nbytes for p in parts))


class NativeOps:
    """The `Ops` of the native backend: quantized matrices and compiled kernels, with a `NumpyOps`
    for the rest."""

    name = "native"
    xp: Any = np
    batch_dependent = True
    """A row's rounding can depend on the rows computed with it: Q4_K matrices round like
    llama.cpp's repacked kernels (a batch's rows in groups of four: its gemm; others: its gemv)."""
    prefill_chunk: int | None = None
    """No preference: the engine's default chunk."""
    prefill_graphs: Any = None
    """No prefill graphs on the CPU."""
    prefill_dtype = ""
    """No tile precision to choose."""

    def __init__(self, threads: int | None = None, options: EngineOptions | None = None) -> None:
        self.options = options or DEFAULT_OPTIONS
        """The tuning knobs (`EngineOptions`: threads, extra compiler flags; None: the defaults)."""
        lib, why = load_library(self.options.native_cflags)
        if lib is None:
            raise RuntimeError(f"native CPU kernels unavailable: {why}")
        self.lib = lib
        self.build_info = why
        self.threads = int(threads or default_threads(self.options))
        self.blas_limited = limit_blas_threads(1) if self.threads > 1 else False
        self._row_bytes: dict[tuple[int, int], int] = {}
        self.numpy = NumpyOps()
        """The reference ops, for what the kernels do not take."""
        # handed over as they are, bound once (no extra call per use in the decode loop)
        self.zeros = self.numpy.zeros
        self.to_host = self.numpy.to_host
        self.kv_store = self.numpy.kv_store
        self.make_decoder = self.numpy.make_decoder
        self.mark = self.numpy.mark
        self.synchronize = self.numpy.synchronize
        self._linear_f32 = self.numpy.linear
        self._attention_ref = self.numpy.attention
        self._gated_act_ref = self.numpy.gated_act

    # --- weights -------------------------------------------------------------------------
    def weight(self, t: TensorInfo) -> Any:
        if t.type_name in GGML_TYPE and len(t.shape) == 2:
            return QWeight(t.raw, t.type_name, (t.shape[0], t.shape[1]))
        return self.numpy.weight(t)

    def concat_rows(self, parts: list[Any]) -> Any:
        if all(isinstance(p, np.ndarray) for p in parts):
            return self.numpy.concat_rows(parts)
        if all(isinstance(p, QWeight) for p in parts) and len({p.type_name for p in parts}) == 1:
            raw = np.concatenate([p.raw for p in parts], axis=0)
            return QWeight(raw, parts[0].type_name, (raw.shape[0], parts[0].shape[1]))
        return QParts(parts)

    def weight_rows(self, ts: list[TensorInfo]) -> Any:
        """The tensors' weights stacked by rows."""
        return self.concat_rows([self.weight(t) for t in ts])

    def finish_uploads(self) -> None:
        """Nothing to finish: the weights are host arrays."""

    def embed_rows(self, table: Any, ids: np.ndarray, cols: int) -> np.ndarray:
        if isinstance(table, QWeight):
            return dequantize_rows(table.raw, table.type_name, ids, cols)
        return self.numpy.embed_rows(table, ids, cols)

    # --- math ----------------------------------------------------------------------------
    def _act_bytes(self, kind: int, n: int) -> int:
        key = (kind, n)
        rb = self._row_bytes.get(key)
        if rb is None:
            rb = self._row_bytes[key] = int(self.lib.qg_act_row_bytes(kind, n))
        return rb

    def quantize_act(self, x: np.ndarray, kind: int) -> np.ndarray:
        """[T, n] float32 -> the kernel's activation blocks (T rows of bytes)."""
        t, n = x.shape
        buf = np.empty((t, self._act_bytes(kind, n)), dtype=np.uint8)
        self.lib.qg_quantize(kind, x.ctypes.data, n, t, n, buf.ctypes.data, self.threads)
        return buf

    def linear(self, x: np.ndarray, w: Any, b: np.ndarray | None = None, aq: str | None = None) -> np.ndarray:
        """[T, in] x [out, in] -> [T, out] (+ bias). Quantized weights go through the C kernel
        (the activation rounding follows from the weight type; `aq` is for float weights)."""
        if isinstance(w, np.ndarray):
            return self._linear_f32(x, w, b, aq)
        x = np.ascontiguousarray(x, dtype=np.float32)
        t, n = x.shape
        parts = w.parts if isinstance(w, QParts) else [w]
        y = np.empty((t, w.shape[0]), dtype=np.float32)
        acts: dict[int, np.ndarray] = {}
        col = 0
        for p in parts:
            rows = p.shape[0]
            if isinstance(p, QWeight):
                a = acts.get(p.kind)
                if a is None:
                    a = acts[p.kind] = self.quantize_act(x, p.kind)
                rc = self.lib.qg_gemm(
                    p.ggml_type,
                    p.ptr,
                    rows,
                    n,
                    a.ctypes.data,
                    t,
                    y.ctypes.data + 4 * col,
                    w.shape[0],
                    None,
                    self.threads,
                )
                if rc != 0:
                    raise ValueError(f"qg_gemm failed for {p!r} with input width {n}")
            else:
                y[:, col : col + rows] = x @ p.T
            col += rows
        if b is not None:
            y += b
        return y

    # --- the rest of the forward pass with llama.cpp's CPU arithmetic (qgemv.c, second half) --
    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """RMSNorm over the last axis as ggml computes it (double sum, float scale, then * w)."""
        shape = x.shape
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, shape[-1])
        y = np.empty(x2.shape, dtype=np.float32)
        w32 = np.ascontiguousarray(w, dtype=np.float32)
        self.lib.qg_rms_norm(
            x2.ctypes.data,
            x2.shape[1],
            w32.ctypes.data,
            y.ctypes.data,
            x2.shape[0],
            x2.shape[1],
            float(eps),
            self.threads,
        )
        return y.reshape(shape)

    def rope_tables(self, n_ctx: int, dim: int, base: float, scale: float) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [n_ctx, dim/2] from ggml's float theta recurrence and libm cosf/sinf."""
        cos = np.empty((n_ctx, dim // 2), dtype=np.float32)
        sin = np.empty_like(cos)
        self.lib.qg_rope_cache(0, n_ctx, dim, float(base), float(1.0 / scale), cos.ctypes.data, sin.ctypes.data)
        return cos, sin

    def norm_rope(
        self, x: np.ndarray, w: np.ndarray | None, eps: float, cos: np.ndarray, sin: np.ndarray, style: str
    ) -> np.ndarray:
        """`rope(rms_norm(x, w, eps))` (no norm where `w` is None): the two ops in turn."""
        return self.rope(x if w is None else self.rms_norm(x, w, eps), cos, sin, style)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
        """Rotate [T, heads, D] with ggml's rounding (one fused multiply-add per output)."""
        out = np.array(x, dtype=np.float32, order="C")
        c = np.ascontiguousarray(cos, dtype=np.float32)
        s = np.ascontiguousarray(sin, dtype=np.float32)
        t, h, d = out.shape
        self.lib.qg_rope(
            out.ctypes.data,
            t,
            h,
            d,
            2 * c.shape[-1],
            c.ctypes.data,
            s.ctypes.data,
            int(style == "neox"),
            self.threads,
        )
        return out

    def attention(self, q: np.ndarray, k_cache: Any, v_cache: Any, start: int, window: int, scale: float) -> np.ndarray:
        """ggml's CPU flash attention over an fp16 cache (other caches: the NumPy path)."""
        if not (
            isinstance(k_cache, np.ndarray)
            and k_cache.dtype == np.float16
            and isinstance(v_cache, np.ndarray)
            and v_cache.dtype == np.float16
            and k_cache.flags.c_contiguous
            and v_cache.flags.c_contiguous
        ):
            return self._attention_ref(q, k_cache, v_cache, start, window, scale)
        q = np.ascontiguousarray(q, dtype=np.float32)
        t, h, d = q.shape
        kv, n_ctx, _ = k_cache.shape
        dv = v_cache.shape[-1]
        out = np.empty((t, h * dv), dtype=np.float32)
        rc = self.lib.qg_attn_f16(
            q.ctypes.data,
            t,
            h,
            d,
            k_cache.ctypes.data,
            v_cache.ctypes.data,
            kv,
            n_ctx,
            dv,
            start,
            window,
            float(scale),
            out.ctypes.data,
            self.threads,
        )
        if rc != 0:
            return self._attention_ref(q, k_cache, v_cache, start, window, scale)
        return out

    def gated_act(self, gate: np.ndarray, up: np.ndarray, kind: str) -> np.ndarray:
        """SwiGLU with ggml's AVX2 exp, or GeGLU with its fp16 GELU table."""
        if (
            kind not in ("silu", "gelu_tanh")
            or gate.dtype != np.float32
            or up.dtype != np.float32
            or gate.shape != up.shape
            or gate.strides != up.strides
            or gate.strides[-1] != 4
        ):
            return self._gated_act_ref(gate, up, kind)
        t, n = gate.shape
        y = np.empty((t, n), dtype=np.float32)
        self.lib.qg_glu(
            int(kind != "silu"),
            gate.ctypes.data,
            up.ctypes.data,
            gate.strides[0] // 4,
            y.ctypes.data,
            t,
            n,
            self.threads,
        )
        return y


_CHECKED: type[Ops] = NativeOps
"""NativeOps is an `Ops` (mypy checks it here)."""
