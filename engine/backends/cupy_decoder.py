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
- greedy chaining reads back 4 bytes (the argmax); `logits` reads back the logits row;
- chained steps (`chain`, `engine.backends.cupy_chain`) read their token and position from `ids`
  as the step before left them there, so the host queues a step before reading the last token.

The launches: `cupy_step` (its GEMVs: `cupy_gemv`). Kernels: `engine.kernels.decode_src`
(compiled by NVRTC for this model's shape and types).
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
from ..kernels import decode_src
from ..kv_cache import Int8Rows
from ..options import DEFAULT_OPTIONS, EngineOptions
from ..quants import dequantize_rows
from .cupy_chain import CupyChain
from .cupy_gemv import Launch, QInput, gemv_launches, qgemv_config
from .cupy_launch import pdl_launcher
from .cupy_plan import ARGMAX_BLOCKS
from .cupy_sample import DeviceSampler
from .cupy_step import step_launches

log = logging.getLogger(__name__)

__all__ = ["CupyDecoder", "QInput", "gemv_launches", "qgemv_config"]
_Launch = Launch  # the name bench/decode_profile.py uses
_H2D = cp.cuda.runtime.memcpyHostToDevice
_D2H = cp.cuda.runtime.memcpyDeviceToHost


@lru_cache(maxsize=8)
def _module(src: str) -> Any:
    return cp.RawModule(code=src, options=("--std=c++17",))


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
        dev = cp.cuda.Device()
        self.n_sm = int(cp.cuda.runtime.getDeviceProperties(dev.id)["multiProcessorCount"])
        self.n_split = decode_src.attn_split(self.n_sm, nkv)
        cluster = max(0, min(8, opts.attn_cluster)) if int(dev.compute_capability) >= 90 else 0
        self.attn_cluster = cluster if cluster <= self.n_split else 0  # the slices' buffers hold n_split
        """Blocks of one thread-block cluster in decode attention (0: `n_split` slices)."""
        self.attn_warps = opts.attn_warps or decode_src.attn_warps(nh // nkv, hd, self.attn_cluster)
        self.row_budget = opts.qgemv_row_budget
        """Row groups an SM the integer GEMVs' threads a row are chosen for (`qgemv_config`; 0: the
        rule, 5)."""
        rope_half = int(next(iter(tf.rope.values()))[0].shape[1])
        types = {p.type_name for lw in tf.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down) for p in w.pieces()}
        types |= {p.type_name for p in tf.output.pieces()}
        if not isinstance(tf.embed_table, TensorInfo):
            types.add(tf.embed_table.type_name)
        shape: dict[str, Any] = {
            "n_heads": nh,
            "n_kv_heads": nkv,
            "head_dim": hd,
            "v_head_dim": vd,
            "rope_half": rope_half,
            "neox": s.traits.rope_style == "neox",
            "kv_half": kv_half,
            "n_split": self.n_split,
            "kv_int8": kv_int8,
            "min_chunk": opts.attn_chunk,
        }
        src = decode_src.source(
            sorted(types),
            **shape,
            warps=self.attn_warps,
            qgemv_unroll=opts.qgemv_unroll,
            qgemv_unroll_glu=opts.qgemv_unroll_glu,
            qgemv_min_blocks=opts.qgemv_min_blocks,
            attn_cluster=self.attn_cluster,
        )
        self.module = _module(src)
        self._fns: dict[str, Any] = {}
        self.attn_blocks = decode_src.attn_blocks(self.n_split, self.attn_cluster)
        """Blocks a KV head in decode attention (the grid's second dimension)."""
        # Past one cluster's positions the clustered kernel's blocks are slices over the grid, of
        # as many warps as in a cluster: slower there than the plain kernel's slices (Qwen3-4B
        # shape at 4,000 positions: 32.1 vs 22.4 us), so a second graph runs the plain kernel
        self.long_from = self.attn_cluster * decode_src.CLUSTER_MIN if self.attn_cluster else 0
        """Attended positions past which a step runs `plan_long` (0: one plan at every length)."""
        self.long_warps = opts.attn_warps or decode_src.attn_warps(nh // nkv, hd)
        self.long_module = None
        if self.long_from:
            long_src = decode_src.source(sorted(types), **shape, warps=self.long_warps, attention_only=True)
            self.long_module = _module(long_src)
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
        buffers = [a for a in vars(self).values() if isinstance(a, cp.ndarray)]  # the arrays above
        self.scratch_bytes = int(sum(a.nbytes for a in buffers) + self.qin.nbytes)
        """Bytes of the step's device buffers (`cupy_plan.decode_scratch_bytes` counts them)."""
        # --- the step as a list of launches, then one graph ---------------------------------
        self.plan: list[Launch] = step_launches(self)
        self.plan_long: list[Launch] | None = step_launches(self, long=True) if self.long_from else None
        """The step past `long_from` attended positions (the layers without a shorter window run
        the plain kernel's `n_split` slices); None where `plan` serves every length."""
        self.pdl = False
        self._set_pdl(pdl_launcher(use_pdl and opts.cupy_pdl))
        self.stream = cp.cuda.Stream(non_blocking=True)
        self._ready = cp.cuda.Event(block=False, disable_timing=True)
        self.graph: Any = None
        self.graph_long: Any = None
        self.mode = "eager"
        # one eager run compiles/loads everything (position n_ctx-1: overwritten before it is read)
        self.ids_host[:] = (0, self.n_ctx - 1, 0, 0)
        self._upload_ids()
        self._eager()
        if self.plan_long is not None:
            self._eager(long=True)
        self.stream.synchronize()
        if use_graph:
            self._capture()
        self.device_sampler = DeviceSampler(int(self.out_logits.size), self.n_ctx + 1, use_graph)
        self.chained = None if self.host_embed else CupyChain(self)
        """The device side of chained steps (`chain`); None for a model whose embedding table stays
        on the host (its row for a token only the device knows cannot be looked up there)."""

    # --- building ---------------------------------------------------------------------------
    def function(self, name: str, long: bool = False) -> Any:
        """The kernel `name` of this decoder's module (compiled for its shape and types); `long`:
        of the module `plan_long` takes its attention from."""
        key = f"long:{name}" if long else name
        fn = self._fns.get(key)
        if fn is None:
            module = self.long_module if long else self.module
            if module is None:
                raise ValueError(f"decoder has no second attention module for {name}")
            fn = self._fns[key] = module.get_function(name)
        return fn

    def _plans(self) -> list[list[Launch]]:
        """`plan`, and `plan_long` where there is one."""
        return [self.plan] if self.plan_long is None else [self.plan, self.plan_long]

    def _set_pdl(self, lib: Any) -> None:
        """Launch every kernel but the first as a programmatic dependent launch (lib: libcuda
        from `pdl_launcher`, or None for plain launches)."""
        try:
            for plan in self._plans():
                for launch in plan[1:]:
                    launch.use_pdl(lib)
        except (AttributeError, TypeError) as exc:  # a CuPy whose kernels hide their CUfunction
            log.warning("decode step: programmatic dependent launch unavailable (%s); plain launches", exc)
            lib = None
            for plan in self._plans():
                for launch in plan:
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
            self.graph = self.graph_long = None
            self.mode = "eager"

    def _capture_once(self) -> None:
        graphs = []
        for plan in self._plans():
            with self.stream:
                self.stream.begin_capture()
                try:
                    for launch in plan:
                        launch()
                finally:
                    graphs.append(self.stream.end_capture())
        self.graph = graphs[0]
        self.graph_long = graphs[1] if len(graphs) > 1 else None
        self.mode = "graph"

    # --- running ----------------------------------------------------------------------------
    def _eager(self, long: bool = False) -> None:
        with self.stream:
            for launch in self.plan_long if long and self.plan_long is not None else self.plan:
                launch()

    def _run(self, pos: int) -> None:
        """Queue the step at position `pos` on the stream (`ids` already holds it): its graph, or
        its launches eagerly; past `long_from` attended positions `plan_long`'s."""
        long = 0 < self.long_from <= pos
        graph = self.graph_long if long else self.graph
        if graph is not None:
            graph.launch(self.stream)
        else:
            self._eager(long)

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
        self._run(pos)

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
            "attn_cluster": self.attn_cluster,
            "long_from": self.long_from,
            "row_budget": self.row_budget,
            "scratch_bytes": self.scratch_bytes,
        }

    takes_mask = True
    """`sample` takes a token mask and a logit bias (`Model.step_sample` keeps them on the device)."""

    def sample(self, token: int, pos: int, params: Any, u: float, history: Any, mask: Any = None) -> int:
        """Feed `token` at `pos`; the next token sampled on the device (`DeviceSampler`: bias and
        mask, penalty, top-k/top-p/min-p, temperature, the uniform draw `u`; temperature 0: the
        argmax of the adjusted row), queued after the step on this decoder's stream: only the id
        comes back. A `Constraint` as `mask` computes its mask while the step runs."""
        self._launch(token, pos)
        return self.device_sampler.sample(self.out_logits, params, u, history, stream=self.stream, mask=mask)

    def chain(self, params: Any) -> CupyChain | None:
        """The device side of a decode loop chained on the device (`engine.decode_chain`) for
        `params` (`SamplingParams`); None where it cannot run (untied embedding on the host)."""
        return self.chained
