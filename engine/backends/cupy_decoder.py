"""The one-token decode step on CUDA: fused kernels, a fixed set of buffers, one CUDA graph.

`CupyOps.make_decoder(transformer)` builds a `CupyDecoder`; `engine.Model` uses it for every
one-token step (`logits(token, pos)`, `greedy(token, pos)`), the generic forward pass for the
rest (prefill). Both write the same KV cache arrays (`transformer.kv.k[i]`, `.v[i]`), so they mix
freely.

How a step runs:
- every activation buffer is allocated once here; the token id and the position live in a small
  device buffer (`ids`: token, position, next token) written by one 8-byte copy from pinned host
  memory before the step, so nothing position-dependent is baked into the launches;
- the whole step (embedding, per layer: norm+rounding+QKV GEMV, Q/K norm+RoPE+KV write, split
  attention, merge, output GEMV + residual, norm+rounding+gate/up GEMV + SwiGLU/GeGLU, down GEMV
  + residual; final norm + head GEMV; argmax) is captured once as a CUDA graph and replayed; where
  capture fails the same launches run eagerly (logged);
- greedy chaining reads back 4 bytes (the argmax); `logits` reads back the logits row.

Kernels: `engine.kernels.decode_src` (compiled by NVRTC for this model's shape and types).
Numerics: the same float operations as the generic path, including llama.cpp's q8 activation
rounding where `layer.aq` asks for it (done inside the GEMV blocks), so decoder and generic
forward agree to float rounding.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from typing import Any

import cupy as cp
import numpy as np

from ..errors import ContextOverflowError
from ..gguf_file import TensorInfo
from ..kernels import decode_src, qdot_src
from ..kv_cache import Int8Rows
from ..options import DEFAULT_OPTIONS, EngineOptions
from ..quants import dequantize_rows
from .cupy_launch import PdlLaunch, pdl_launcher
from .cupy_sample import DeviceSampler

log = logging.getLogger(__name__)

ROWS_PER_BLOCK = 8  # warps per GEMV block, one row each
GEMV_THREADS = 32 * ROWS_PER_BLOCK
ARGMAX_BLOCKS = 64
GRID_CAP = 4  # GEMV blocks per multiprocessor at most (rows are strided over the grid)
AQ_CODE = {None: 0, "q8_0": 1, "q8_k": 2}
_H2D = cp.cuda.runtime.memcpyHostToDevice
_D2H = cp.cuda.runtime.memcpyDeviceToHost


@lru_cache(maxsize=8)
def _module(src: str) -> Any:
    return cp.RawModule(code=src, options=("--std=c++17",))


def _null() -> np.uint64:
    return np.uint64(0)


def _ptr(a: Any) -> Any:
    return _null() if a is None else a


def _cache_arrays(layer: Any) -> tuple[Any, Any]:
    """(values, int8 scales or None) of one layer's K or V cache."""
    if isinstance(layer, Int8Rows):
        return layer.q, layer.d
    return layer, None


class _Launch:
    """One kernel launch with its arguments fixed (device pointers, sizes); `use_pdl` switches it
    to a programmatic dependent launch (`cupy_launch`) on the current stream."""

    __slots__ = ("fn", "grid", "block", "args", "smem", "name", "pdl")

    def __init__(
        self,
        fn: Any,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple[Any, ...],
        smem: int = 0,
        name: str = "",
    ) -> None:
        self.fn, self.grid, self.block, self.args, self.smem, self.name = fn, grid, block, args, smem, name
        self.pdl: PdlLaunch | None = None

    def use_pdl(self, lib: Any) -> None:
        self.pdl = None if lib is None else PdlLaunch(lib, self.fn, self.grid, self.block, self.args, self.smem)

    def __call__(self) -> None:
        if self.pdl is not None:
            self.pdl(cp.cuda.get_current_stream().ptr)
        else:
            self.fn(self.grid, self.block, self.args, shared_mem=self.smem)


USE_QGEMV = True  # integer dot products where the activation rounding is on (False: float path)


def qgemv_config(type_name: str, rows: int, n_sm: int, cols: int = 0) -> tuple[int, int]:
    """(threads per row, grid cap in blocks per SM) of the integer GEMV.

    Inputs of >= 1536 values (v7, timed with the weights coming from DRAM, each launch after an
    L2 flush: bench/results/decode_profile-*-v7a*/v7b*.txt): the most threads a row (64, 32, 16) that
    keeps the row groups within 5 a multiprocessor, one group a block (cap 8): Qwen3-4B shape
    2560x9728 15.4 -> 11.0 us, 4096x2560 8.1 -> 6.7 us, 2560x4096 7.8 -> 6.7 us, gate/up 19.5 ->
    15.6 us. Smaller inputs (SmolLM2, timed v3b): 16 threads a row from 4096 rows up, else 32;
    the heads (>= 32768 rows) 8 (SmolLM2 head 9.8 vs 12.4 us); Q6_K likes a cap of 8."""
    if cols >= 1536:
        for tpr in (64, 32, 16):
            if rows * tpr <= 5 * n_sm * 256:
                return tpr, 8
        return 8, 8
    if rows >= 32768:
        tpr = 8
    elif rows >= 4096:
        tpr = 16
    else:  # few rows of long inputs: more threads a row (v4 profile: 1024x2560 3.2 vs 3.6 us)
        tpr = 64 if rows <= 1024 and cols >= 1536 else 32
    return tpr, (8 if type_name == "Q6_K" else 4)


class QInput:
    """A matrix input rounded to int8 blocks (`qprep_x`): values, per-block scales, per-16 sums.
    Sized for the widest input; one serves every GEMV of a step (they run one after another)."""

    def __init__(self, cols: int) -> None:
        self.cols = cols
        self.xq = cp.zeros(cols, dtype=cp.int8)
        self.xd = cp.zeros(max(1, cols // 32), dtype=cp.float32)
        self.xs16 = cp.zeros(max(1, cols // 16), dtype=cp.int32)

    @property
    def nbytes(self) -> int:
        return int(self.xq.nbytes + self.xd.nbytes + self.xs16.nbytes)


def gemv_launches(
    fn: Any,
    n_sm: int,
    w: Any,
    x: cp.ndarray,
    nw: cp.ndarray | None,
    eps: np.float32,
    aq: str | None,
    y: cp.ndarray,
    bias: cp.ndarray | None = None,
    epi: int = 0,
    out_rows: int | None = None,
    qin: QInput | None = None,
    input_ready: bool = False,
) -> list[_Launch]:
    """The launches of y = W @ prep(x) (norm by `nw`, llama.cpp rounding `aq`) with epilogue `epi`:
    where W's type has an integer dot product and the rounding is on, one `qprep_x` launch rounds
    the input into `qin` (allocated here when not given), then the integer-dot kernel
    (`qgemv_<T>`) reads it; other pieces use the float kernel (`dgemv_<T>`, which prepares its
    input itself). `fn(name)` gives a compiled kernel of the decode module."""
    out: list[_Launch] = []
    cols = w.shape[1]
    code = AQ_CODE[aq]
    prepped = input_ready  # the producer of x already rounded it into `qin`
    r0 = 0
    for p in w.pieces():
        rows = p.shape[0] if out_rows is None else out_rows
        b = None if bias is None else bias[r0 : r0 + rows]
        if USE_QGEMV and qdot_src.QTYPES.get(p.type_name) == code:
            if qin is None or qin.cols < cols:
                qin = QInput(cols)
            glu = epi >= 2
            tpr, cap = qgemv_config(p.type_name, rows, n_sm, cols)
            blocks = max(1, min(-(-rows // (256 // tpr)), cap * n_sm))
            name = f"qgemv_{p.type_name}[{rows}x{cols}]"
            tail = (y[r0:], _ptr(b), np.int32(epi), np.int32(out_rows or 0), np.int32(tpr))
            if not prepped:
                groups = cols // (32 if code == 1 else 256)
                out.append(
                    _Launch(
                        fn("qprep_x"),
                        (max(1, -(-groups // 8)),),
                        (256,),
                        (x, _ptr(nw), eps, np.int32(code), np.int32(cols), qin.xq, qin.xd, qin.xs16),
                        0,
                        f"qprep[{cols}]",
                    )
                )
                prepped = True
            k = fn(f"qgemv{'_glu' if glu else ''}_{p.type_name}")
            args = (p.raw, np.int64(p.raw.shape[1]), np.int32(rows), np.int32(cols), qin.xq, qin.xd, qin.xs16, *tail)
            out.append(_Launch(k, (blocks,), (256,), args, 0, name))
        else:
            args = (
                p.raw,
                np.int64(p.raw.shape[1]),
                np.int32(rows),
                np.int32(cols),
                x,
                _ptr(nw),
                eps,
                np.int32(code),
                y[r0:],
                _ptr(b),
                np.int32(epi),
                np.int32(out_rows or 0),
            )
            # two rows a warp where that still fills the GPU (more loads in flight per lane)
            r = 2 if epi < 2 and -(-rows // (2 * ROWS_PER_BLOCK)) >= n_sm else 1
            k = fn(f"dgemv{'2' if r == 2 else ''}_{p.type_name}")
            smem = cols * 4
            if smem > 48 * 1024:
                k.max_dynamic_shared_size_bytes = smem
            blocks = max(1, min(-(-rows // (r * ROWS_PER_BLOCK)), GRID_CAP * n_sm))
            out.append(_Launch(k, (blocks,), (GEMV_THREADS,), args, smem, f"gemv_{p.type_name}[{rows}x{cols}]"))
        r0 += rows
    return out


class CupyDecoder:
    """A model's decode step as preallocated buffers + a captured CUDA graph (see module doc)."""

    def __init__(
        self, tf: Any, use_graph: bool = True, use_pdl: bool = True, options: EngineOptions | None = None
    ) -> None:
        opts = options or DEFAULT_OPTIONS
        self.options = opts
        """The tuning knobs the step was built with (`EngineOptions`; None: the defaults)."""
        s = tf.spec
        self.tf = tf
        self.spec = s
        self.n_ctx = int(tf.n_ctx)
        e, hd, vd, nh, nkv = s.n_embd, s.head_dim, s.v_head_dim, s.n_heads, s.n_kv_heads
        kv_half = tf.kv.k[0].dtype == cp.float16
        kv_int8 = isinstance(tf.kv.k[0], Int8Rows)
        self.attn_warps = opts.attn_warps or decode_src.attn_warps(nh // nkv, hd)
        dev = cp.cuda.Device()
        self.n_sm = int(cp.cuda.runtime.getDeviceProperties(dev.id)["multiProcessorCount"])
        self.n_split = max(1, min(64, -(-2 * self.n_sm // nkv)))  # slices of >= 32 positions
        rope_half = int(next(iter(tf.rope.values()))[0].shape[1])
        types = {p.type_name for lw in tf.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down) for p in w.pieces()}
        types |= {p.type_name for p in tf.output.pieces()}
        if not isinstance(tf.embed_table, TensorInfo):
            types.add(tf.embed_table.type_name)
        src = decode_src.source(
            sorted(types),
            n_heads=nh,
            n_kv_heads=nkv,
            head_dim=hd,
            v_head_dim=vd,
            rope_half=rope_half,
            neox=s.traits.rope_style == "neox",
            kv_half=kv_half,
            n_split=self.n_split,
            kv_int8=kv_int8,
            min_chunk=opts.attn_chunk,
            warps=self.attn_warps,
            qgemv_unroll=opts.qgemv_unroll,
            qgemv_unroll_glu=opts.qgemv_unroll_glu,
        )
        self.module = _module(src)
        self._fns: dict[str, Any] = {}
        # --- buffers (allocated once) -------------------------------------------------------
        f32 = cp.float32
        qkv_rows = tf.layers[0].wqkv.shape[0]
        self.ids = cp.zeros(4, dtype=cp.int32)  # token, position, next token (argmax)
        self.x = cp.zeros(e, dtype=f32)
        self.tmp = cp.zeros(e, dtype=f32)
        self.qkv = cp.zeros(qkv_rows, dtype=f32)
        self.q = cp.zeros(nh * hd, dtype=f32)
        self.attn = cp.zeros(nh * vd, dtype=f32)
        self.pm = cp.zeros(nh * self.n_split, dtype=f32)
        self.pl = cp.zeros(nh * self.n_split, dtype=f32)
        self.pacc = cp.zeros(nh * self.n_split * vd, dtype=f32)
        self.gu = cp.zeros(2 * s.n_ff, dtype=f32)
        self.act = cp.zeros(s.n_ff, dtype=f32)
        self.qin = QInput(max(e, s.n_ff, nh * vd))  # the rounded input of every integer GEMV
        self.out_logits = cp.zeros(tf.output.shape[0], dtype=f32)
        self._ids_mem = cp.cuda.alloc_pinned_memory(16)
        self.ids_host = np.frombuffer(self._ids_mem, np.int32, 4)
        self._logits_mem = cp.cuda.alloc_pinned_memory(self.out_logits.nbytes)
        self.counters = cp.zeros(nkv + 1, dtype=cp.int32)  # last-block counters (attention, argmax)
        self.best_v = cp.zeros(ARGMAX_BLOCKS, dtype=f32)
        self.best_i = cp.zeros(ARGMAX_BLOCKS, dtype=cp.int32)
        self.logits_host = np.frombuffer(self._logits_mem, np.float32, self.out_logits.size)
        self.host_embed = isinstance(tf.embed_table, TensorInfo)
        self._x_mem = cp.cuda.alloc_pinned_memory(self.x.nbytes)
        self.x_host = np.frombuffer(self._x_mem, np.float32, e)
        self.embed_scale = np.float32(math.sqrt(e)) if s.traits.embed_scale else np.float32(1.0)
        self.scratch_bytes = int(
            sum(
                a.nbytes
                for a in (
                    self.ids,
                    self.x,
                    self.tmp,
                    self.qkv,
                    self.q,
                    self.attn,
                    self.pm,
                    self.pl,
                    self.pacc,
                    self.gu,
                    self.act,
                    self.out_logits,
                    self.counters,
                    self.best_v,
                    self.best_i,
                )
            )
            + self.qin.nbytes
        )
        # --- the step as a list of launches, then one graph ---------------------------------
        self.plan: list[_Launch] = []
        self._build_plan()
        self.pdl = False
        self._set_pdl(pdl_launcher(use_pdl and opts.cupy_pdl))
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._ready = cp.cuda.Event(block=False, disable_timing=True)
        self.graph: Any = None
        self.mode = "eager"
        # one eager run compiles/loads everything (position n_ctx-1: overwritten before it is read)
        self.ids_host[:] = (0, self.n_ctx - 1, 0, 0)
        self._upload_ids()
        self._eager()
        self.stream.synchronize()
        if use_graph:
            self._capture()
        self.device_sampler = DeviceSampler(int(self.out_logits.size), self.n_ctx + 1, use_graph)

    # --- building ---------------------------------------------------------------------------
    def _fn(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self.module.get_function(name)
        return fn

    def _gemv(
        self,
        w: Any,
        x: cp.ndarray,
        nw: cp.ndarray | None,
        aq: str | None,
        y: cp.ndarray,
        bias: cp.ndarray | None = None,
        epi: int = 0,
        out_rows: int | None = None,
        input_ready: bool = False,
    ) -> None:
        """y = W @ prep(x) with epilogue `epi` (0 store+bias, 1 add, 2 SwiGLU, 3 GeGLU);
        `input_ready`: x was already rounded into `self.qin` by the launch before."""
        self.plan.extend(
            gemv_launches(
                self._fn,
                self.n_sm,
                w,
                x,
                nw,
                np.float32(self.spec.norm_eps),
                aq,
                y,
                bias,
                epi,
                out_rows,
                self.qin,
                input_ready,
            )
        )

    def _rounds_input(self, w: Any, aq: str | None, group: int) -> int:
        """The rounding code (1 q8_0, 2 q8_k) a producer writing `group` consecutive values per
        block may apply for W's integer GEMV, or 0 where W takes the float path or the groups
        would straddle two producers."""
        code = AQ_CODE[aq]
        pieces = w.pieces()
        if not (USE_QGEMV and code and len(pieces) == 1 and qdot_src.QTYPES.get(pieces[0].type_name) == code):
            return 0
        return code if group % (32 if code == 1 else 256) == 0 else 0

    def _build_plan(self) -> None:
        tf, s = self.tf, self.spec
        eps = np.float32(s.norm_eps)
        e, nh, nkv = s.n_embd, s.n_heads, s.n_kv_heads
        if not self.host_embed:
            t = tf.embed_table
            self.plan.append(
                _Launch(
                    self._fn(f"embed_{t.type_name}"),
                    (-(-(e // 32) // 128),),
                    (128,),
                    (t.raw, np.int64(t.raw.shape[1]), self.ids, self.x, np.int32(e), self.embed_scale),
                    0,
                    "embed",
                )
            )
        for i, lw in enumerate(tf.layers):
            (kc, kd), (vc, vd) = _cache_arrays(tf.kv.k[i]), _cache_arrays(tf.kv.v[i])
            cos, sin = tf.rope[s.layer_rope_base(i)]
            self._gemv(lw.wqkv, self.x, lw.attn_norm, lw.aq["qkv"], self.qkv, lw.bqkv)
            self.plan.append(
                _Launch(
                    self._fn("qkv_post"),
                    (nh + 2 * nkv,),
                    (128,),
                    (
                        self.qkv,
                        self.q,
                        kc,
                        vc,
                        _ptr(kd),
                        _ptr(vd),
                        self.ids,
                        cos,
                        sin,
                        _ptr(lw.q_norm),
                        _ptr(lw.k_norm),
                        np.int32(self.n_ctx),
                        eps,
                    ),
                    0,
                    "qkv_post",
                )
            )
            window = s.sliding_window if s.is_swa_layer(i) else 0
            # attention's last block per KV head also rounds its heads for the output projection
            o_round = self._rounds_input(lw.wo, lw.aq["o"], (nh // nkv) * s.v_head_dim)
            self.plan.append(
                _Launch(
                    self._fn("attn_decode"),
                    (nkv, self.n_split),
                    (32 * self.attn_warps,),
                    (
                        self.q,
                        kc,
                        vc,
                        _ptr(kd),
                        _ptr(vd),
                        self.ids,
                        self.pm,
                        self.pl,
                        self.pacc,
                        self.counters,
                        self.attn,
                        np.int32(self.n_ctx),
                        np.int32(window),
                        np.float32(s.attn_scale),
                        np.int32(o_round),
                        self.qin.xq,
                        self.qin.xd,
                        self.qin.xs16,
                    ),
                    0,
                    "attn",
                )
            )
            self._residual(lw.wo, self.attn, lw.aq["o"], lw.post_attn_norm, input_ready=o_round > 0)
            gelu = s.traits.activation != "silu"
            if lw.w_gate_up.raw is not None:  # gate and up share a type: one pass, fused GLU
                self._gemv(
                    lw.w_gate_up, self.x, lw.ffn_norm, lw.aq["gate_up"], self.act, epi=3 if gelu else 2, out_rows=s.n_ff
                )
            else:
                self._gemv(lw.w_gate_up, self.x, lw.ffn_norm, lw.aq["gate_up"], self.gu)
                self.plan.append(
                    _Launch(
                        self._fn("glu"),
                        (-(-s.n_ff // 256),),
                        (256,),
                        (self.gu, self.act, np.int32(s.n_ff), np.int32(gelu)),
                        0,
                        "glu",
                    )
                )
            self._residual(lw.w_down, self.act, lw.aq["down"], lw.post_ffn_norm)
        self._gemv(tf.output, self.x, tf.output_norm, tf.output_aq, self.out_logits)
        self.plan.append(
            _Launch(
                self._fn("argmax_ids"),
                (ARGMAX_BLOCKS,),
                (512,),
                (
                    self.out_logits,
                    np.int32(self.out_logits.size),
                    self.best_v,
                    self.best_i,
                    self.counters[nkv:],
                    self.ids,
                ),
                0,
                "argmax",
            )
        )

    def _residual(
        self, w: Any, inp: cp.ndarray, aq: str | None, post_norm: cp.ndarray | None, input_ready: bool = False
    ) -> None:
        """x += W @ inp, or x += rms_norm(W @ inp) * post_norm (gemma3)."""
        if post_norm is None:
            self._gemv(w, inp, None, aq, self.x, epi=1, input_ready=input_ready)
            return
        self._gemv(w, inp, None, aq, self.tmp, input_ready=input_ready)
        self.plan.append(
            _Launch(
                self._fn("add_rmsnorm"),
                (1,),
                (256,),
                (self.x, self.tmp, post_norm, np.int32(self.spec.n_embd), np.float32(self.spec.norm_eps)),
                0,
                "add_rmsnorm",
            )
        )

    def _set_pdl(self, lib: Any) -> None:
        """Launch every kernel but the first as a programmatic dependent launch (lib: libcuda
        from `pdl_launcher`, or None for plain launches)."""
        try:
            for launch in self.plan[1:]:
                launch.use_pdl(lib)
        except (AttributeError, TypeError) as exc:  # a CuPy whose kernels hide their CUfunction
            log.warning("decode step: programmatic dependent launch unavailable (%s); plain launches", exc)
            lib = None
            for launch in self.plan:
                launch.use_pdl(None)
        self.pdl = lib is not None

    def _capture(self) -> None:
        if self.pdl:
            try:
                self._capture_once()
                return
            except Exception as exc:  # a driver that cannot record programmatic edges
                log.warning(
                    "decode step: capture with programmatic dependent launch failed (%s: %s); plain launches",
                    type(exc).__name__,
                    exc,
                )
                self._set_pdl(None)
        try:
            self._capture_once()
        except Exception as exc:  # driver / CuPy without graph support: eager launches
            log.warning("decode step: CUDA graph capture failed (%s: %s); launching eagerly", type(exc).__name__, exc)
            self.graph = None
            self.mode = "eager"

    def _capture_once(self) -> None:
        with self.stream:
            self.stream.begin_capture()
            try:
                for launch in self.plan:
                    launch()
            finally:
                graph = self.stream.end_capture()
        self.graph = graph
        self.mode = "graph"

    # --- running ----------------------------------------------------------------------------
    def _eager(self) -> None:
        with self.stream:
            for launch in self.plan:
                launch()

    def _upload_ids(self) -> None:
        cp.cuda.runtime.memcpyAsync(self.ids.data.ptr, self.ids_host.ctypes.data, 8, _H2D, self.stream.ptr)

    def _launch(self, token: int, pos: int) -> None:
        if not 0 <= pos < self.n_ctx:
            raise ContextOverflowError(pos + 1, self.n_ctx)
        if not 0 <= token < self.spec.n_vocab:
            raise ValueError(f"token id {token} out of range")
        # work queued on the caller's stream (a generic prefill) comes first
        self._ready.record(cp.cuda.get_current_stream())
        self.stream.wait_event(self._ready)
        self.ids_host[0] = token
        self.ids_host[1] = pos
        if self.host_embed:
            t = self.tf.embed_table
            row = dequantize_rows(t.raw, t.type_name, np.array([token]), self.spec.n_embd)[0]
            np.multiply(row, self.embed_scale, out=self.x_host)
            cp.cuda.runtime.memcpyAsync(self.x.data.ptr, self.x_host.ctypes.data, self.x.nbytes, _H2D, self.stream.ptr)
        self._upload_ids()
        if self.graph is not None:
            self.graph.launch(self.stream)
        else:
            self._eager()

    def logits(self, token: int, pos: int) -> np.ndarray:
        """Feed `token` at `pos` (K/V written at `pos`); the logits [vocab] as float32 on the host."""
        self._launch(token, pos)
        cp.cuda.runtime.memcpyAsync(
            self.logits_host.ctypes.data, self.out_logits.data.ptr, self.out_logits.nbytes, _D2H, self.stream.ptr
        )
        self.stream.synchronize()
        return self.logits_host.copy()

    def greedy(self, token: int, pos: int) -> int:
        """Feed `token` at `pos`; the id of the largest logit (argmax on the device)."""
        self._launch(token, pos)
        cp.cuda.runtime.memcpyAsync(self.ids_host.ctypes.data + 8, self.ids.data.ptr + 8, 4, _D2H, self.stream.ptr)
        self.stream.synchronize()
        return int(self.ids_host[2])

    def describe(self) -> dict[str, Any]:
        """Launch count, mode and buffer bytes (for logs and benchmarks)."""
        return {
            "mode": self.mode,
            "launches": len(self.plan),
            "pdl": self.pdl,
            "n_split": self.n_split,
            "scratch_bytes": self.scratch_bytes,
        }

    def sample(self, token: int, pos: int, params: Any, u: float, history: Any) -> int:
        """Feed `token` at `pos`; the next token sampled on the device (`DeviceSampler`: penalty,
        top-k/top-p/min-p, temperature, the uniform draw `u`), queued after the step on this
        decoder's stream: only the id comes back."""
        self._launch(token, pos)
        return self.device_sampler.sample(self.out_logits, params, u, history, stream=self.stream)
