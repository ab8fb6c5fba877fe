"""The model: weights, one forward pass shared by every architecture, and the public facade.

A block is ``h = x + attn(norm(x)); out = h + ffn(norm(h))``; the architecture options
(`spec.traits`) switch biases, Q/K norms, post norms, sliding windows, GeGLU and embedding scale.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends.ops import Ops
from .errors import ContextOverflowError, ModelFormatError
from .gguf_file import SUPPORTED_TYPES, GGUFFile, TensorInfo
from .kv_cache import KVCache, kv_bytes
from .options import EngineOptions
from .spec import ModelSpec, read_spec

# How llama.cpp's CPU path rounds the activations that meet a weight of each type.
ACT_QUANT = {
    "Q4_0": "q8_0",
    "Q5_0": "q8_0",
    "Q8_0": "q8_0",
    "Q4_1": "q8_0",
    "Q5_1": "q8_0",
    "Q4_K": "q8_k",
    "Q5_K": "q8_k",
    "Q6_K": "q8_k",
}


def act_quant_of(*tensors: TensorInfo) -> str | None:
    """The activation rounding for a (fused) weight; None when its parts disagree or are float."""
    kinds = {ACT_QUANT.get(t.type_name) for t in tensors}
    return kinds.pop() if len(kinds) == 1 else None


@dataclass
class LayerWeights:
    """Weights of one block, in the backend's array type (QKV and gate+up fused)."""

    attn_norm: Any
    wqkv: Any
    bqkv: Any | None
    q_norm: Any | None
    k_norm: Any | None
    wo: Any
    post_attn_norm: Any | None
    ffn_norm: Any
    w_gate_up: Any
    w_down: Any
    post_ffn_norm: Any | None
    aq: dict[str, str | None]
    """Activation rounding per matrix (``qkv``, ``o``, ``gate_up``, ``down``)."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes the model needs, planned before anything is allocated (`plan_memory`)."""

    weights: int
    """Weights as the backend stores them."""
    kv: int
    """KV cache at the planned context."""
    decode_scratch: int
    """Fixed buffers of the one-token decode step (0 where the backend has none)."""
    prefill_scratch: int
    """Largest prefill chunk: its activations and the backend's prefill buffers."""
    n_ctx: int
    tables: int = 0
    """RoPE tables (cos, sin) where the plan counts them (the CuPy plan does)."""
    chunk: int = 64
    """Prefill chunk (tokens) the plan is made for."""
    backend: str = "numpy"
    parts: tuple[tuple[str, int], ...] = ()
    """Finer breakdown (name, bytes) of the scratch parts, where the backend gives one."""
    kv_dtype: str = "f16"
    """KV cache element type the plan is made for."""

    @property
    def scratch(self) -> int:
        """Everything besides weights and KV."""
        return self.decode_scratch + self.prefill_scratch + self.tables

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch


def _check_types(gf: GGUFFile) -> None:
    for t in gf.tensors.values():
        if t.type_name not in SUPPORTED_TYPES:
            raise ModelFormatError(
                gf.path,
                t.name,
                f"tensor type {t.type_name} is not supported (supported: {', '.join(sorted(SUPPORTED_TYPES))})",
            )


def _tensor(gf: GGUFFile, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
    t = gf.tensors.get(name)
    if t is None:
        raise ModelFormatError(gf.path, name, "required tensor is missing")
    if shape is not None and t.shape != shape:
        raise ModelFormatError(gf.path, name, f"shape {t.shape}, expected {shape}")
    return t


def plan_on(gf: GGUFFile, n_ctx: int, kv_dtype: str, backend: str, options: EngineOptions | None = None) -> MemoryPlan:
    """The memory plan of `gf` loaded on the resolved `backend` ("numpy", "native": 2-D weights kept in
    their blocks, "cupy"), as `load_model` with these `options` would load it."""
    return plan_memory(
        gf, read_spec(gf), n_ctx, kv_dtype, quantized=backend == "native", backend=backend, options=options
    )


def plan_memory(
    gf: GGUFFile,
    spec: ModelSpec,
    n_ctx: int,
    kv_dtype: str,
    chunk: int | None = None,
    quantized: bool = False,
    backend: str | None = None,
    last_n: int = 1,
    prefill_dtype: str | None = None,
    options: EngineOptions | None = None,
) -> MemoryPlan:
    """Memory plan of `backend` (None: the CPU backends) at `n_ctx` for prefill chunks of `chunk`
    tokens (default: the options' `prefill_chunk`, else the backend's own, 64 on CPU, 512 on CuPy).

    CPU: the float32 NumPy backend (weights dequantized); `quantized`: the backend keeps 2-D
    block-quantized matrices as stored (native CPU backend), only the other tensors count as
    float32; scratch is an estimate of one chunk's activations.
    "cupy": what the CuPy backend allocates on the GPU (`engine.backends.cupy_plan`): weights as
    stored, KV, RoPE tables, the decode step's buffers, and the prefill tile buffer, attention
    buffers and activations of one chunk returning `last_n` rows of logits, with the prefill
    tile precision `prefill_dtype` (None: the options' `cupy_prefill`) under `options` (None: the
    environment's, `EngineOptions.from_env`, as `engine.load_model` without options).
    """
    chunk = chunk or (options.prefill_chunk if options is not None else None)
    if backend == "cupy":
        from .backends import cupy_plan

        g = cupy_plan.plan(gf, spec, n_ctx, kv_dtype, chunk or cupy_plan.PREFILL_CHUNK, last_n, prefill_dtype, options)
        return MemoryPlan(
            g.weights,
            g.kv,
            g.decode_scratch,
            g.prefill_scratch,
            n_ctx,
            tables=g.tables,
            chunk=g.chunk,
            backend="cupy",
            parts=(
                ("prefill_tiles", g.tiles),
                ("prefill_kv_rows", g.kv_rows),
                ("prefill_scores", g.scores),
                ("prefill_activations", g.activations),
                ("prefill_graphs", g.graphs),
            ),
            kv_dtype=kv_dtype,
        )
    chunk = chunk or 64
    weights = 0
    for t in gf.tensors.values():
        if quantized and len(t.shape) == 2 and t.type_name in ACT_QUANT:
            weights += t.nbytes
        else:
            weights += int(np.prod(t.shape)) * 4
    if "output.weight" not in gf.tensors:
        pass  # tied head: the embedding table is dequantized once and shared
    width = max(spec.n_embd, spec.n_heads * spec.head_dim * 3, 2 * spec.n_ff)
    scratch = chunk * (width * 4 * 4 + spec.n_vocab * 4) + spec.n_heads * chunk * n_ctx * 4
    return MemoryPlan(
        weights,
        kv_bytes(spec, n_ctx, kv_dtype),
        0,
        scratch,
        n_ctx,
        chunk=chunk,
        backend="native" if quantized else "numpy",
        kv_dtype=kv_dtype,
    )


@dataclass
class Pass:
    """A forward pass between two pieces (`Transformer.begin` / `run_layers` / `end`): the
    activations after `layer` layers, kept on the device while the pass is paused."""

    x: Any
    """[T, E] (or [keep, E] past the last layer's row cut) after `layer` layers."""
    t: int
    start: int
    keep: int
    hidden: bool
    layer: int = 0
    """Layers run so far."""
    tokens: list[int] = field(default_factory=list)
    """The pass's token ids, where a caller keeps them with it (`Model.prefill_pass`)."""
    queued: Any = None
    """An event after the pass's newest piece while that piece may still run on the device
    (`Model.prefill_layers` keeps one piece queued ahead; `Model.prefill_settle` waits for it)."""
    replay: Any = None
    """The graphs that replay this pass (`Transformer.begin_replay`; `x` stays None), or None."""


class Transformer:
    """Weights + KV cache + forward pass. Not thread-safe: callers hold `lock`."""

    def __init__(self, gf: GGUFFile, spec: ModelSpec, ops: Ops, n_ctx: int, kv_dtype: str) -> None:
        _check_types(gf)
        self.spec = spec
        self.ops: Ops = ops
        self.lock = threading.Lock()
        e, hd, vd = spec.n_embd, spec.head_dim, spec.v_head_dim
        q_rows, kv_rows = spec.n_heads * hd, spec.n_kv_heads * hd
        emb = _tensor(gf, "token_embd.weight")
        if emb.shape[-1] != e:
            raise ModelFormatError(gf.path, "token_embd.weight", f"width {emb.shape[-1]}, expected {e}")
        out = gf.tensors.get("output.weight")
        self.output_aq = act_quant_of(out if out is not None else emb)
        if out is None:  # tied head: one float32 table serves lookup and logits
            self.output = ops.weight(emb)
            self.embed_table: Any = self.output
        else:
            self.output = ops.weight(out)
            self.embed_table = emb  # rows dequantized on lookup
        self.output_norm = ops.weight(_tensor(gf, "output_norm.weight", (e,)))
        tr = spec.traits
        self.layers: list[LayerWeights] = []
        for i in range(spec.n_layers):
            p = f"blk.{i}."

            def ti(name: str, shape: tuple[int, ...] | None = None, p: str = p) -> TensorInfo:
                return _tensor(gf, p + name, shape)

            def w(name: str, shape: tuple[int, ...] | None = None, p: str = p) -> Any:
                return ops.weight(_tensor(gf, p + name, shape))

            def aq(*names: str, p: str = p) -> str | None:
                return act_quant_of(*(gf.tensors[p + n] for n in names))

            def opt(name: str, p: str = p) -> Any | None:
                t = gf.tensors.get(p + name)
                return None if t is None else ops.weight(t)

            biases = [opt("attn_q.bias"), opt("attn_k.bias"), opt("attn_v.bias")]
            bqkv = None
            if any(b is not None for b in biases):
                if any(b is None for b in biases):
                    raise ModelFormatError(gf.path, p + "attn_q.bias", "Q/K/V biases must all exist")
                bqkv = ops.xp.concatenate(biases)
            self.layers.append(
                LayerWeights(
                    attn_norm=w("attn_norm.weight", (e,)),
                    wqkv=ops.weight_rows(
                        [
                            ti("attn_q.weight", (q_rows, e)),
                            ti("attn_k.weight", (kv_rows, e)),
                            ti("attn_v.weight", (spec.n_kv_heads * vd, e)),
                        ]
                    ),
                    bqkv=bqkv,
                    q_norm=w("attn_q_norm.weight", (hd,)) if tr.qk_norm else None,
                    k_norm=w("attn_k_norm.weight", (hd,)) if tr.qk_norm else None,
                    wo=w("attn_output.weight", (e, spec.n_heads * vd)),
                    post_attn_norm=w("post_attention_norm.weight", (e,)) if tr.post_norms else None,
                    ffn_norm=w("ffn_norm.weight", (e,)),
                    w_gate_up=ops.weight_rows(
                        [ti("ffn_gate.weight", (spec.n_ff, e)), ti("ffn_up.weight", (spec.n_ff, e))]
                    ),
                    w_down=w("ffn_down.weight", (e, spec.n_ff)),
                    post_ffn_norm=w("post_ffw_norm.weight", (e,)) if tr.post_norms else None,
                    aq={
                        "qkv": aq("attn_q.weight", "attn_k.weight", "attn_v.weight"),
                        "o": aq("attn_output.weight"),
                        "gate_up": aq("ffn_gate.weight", "ffn_up.weight"),
                        "down": aq("ffn_down.weight"),
                    },
                )
            )
        self.n_ctx = n_ctx
        self.kv = KVCache.allocate(ops, spec, n_ctx, kv_dtype)
        rope_dim = min(spec.rope_dim, hd)
        self.rope = {
            base: ops.rope_tables(n_ctx, rope_dim, base, spec.rope_scale)
            for base in {spec.layer_rope_base(i) for i in range(spec.n_layers)}
        }
        self.weights_bytes = int(
            sum(a.nbytes for a in _arrays(self.layers)) + self.output.nbytes + self.output_norm.nbytes
        )
        ops.finish_uploads()  # CuPy reads the weights' bytes here, all at once

    # ------------------------------------------------------------------------------------
    def forward(
        self, ids: Sequence[int], start: int, last_n: int | None = 1, hidden: bool = False, graph: bool = True
    ) -> Any:
        """Run `ids` at positions start.. through the model, writing their K/V into the cache.

        Returns logits [n, vocab] for the last `last_n` positions (all when None); `hidden`: the
        last layer's output [T, E] instead (no output norm, no head). A backend with prefill
        graphs (`ops.prefill_graphs`, CuPy: first chunks, and later chunks through
        `begin_replay`) replays the pass where it can unless `graph` is False; `ids` may then
        also be a device array.
        """
        t = len(ids)
        if start + t > self.n_ctx:
            raise ContextOverflowError(start + t, self.n_ctx)
        graphs = self.ops.prefill_graphs if graph and not hidden else None
        if graphs is not None:
            bucket = graphs.bucket_for(t, start, last_n, self.n_ctx)
            if bucket is not None:
                out = graphs.run(self, ids, bucket)
                if out is not None:
                    return out
            replay = self.begin_replay(ids, start, 0) if last_n == 1 else None
            if replay is not None:
                self.run_layers(replay, 0, len(self.layers))
                return self.end(replay)
        p = self.begin(ids, start, last_n, hidden)
        self.run_layers(p, 0, len(self.layers))
        return self.end(p)

    # A pass in pieces: `begin` (embedding), `run_layers` over consecutive groups of layers,
    # `end` (head). `forward` is the three at once; the same ops run in the same order either
    # way, so a pass run in pieces - with pauses between them - gives the same bits.
    def begin(self, ids: Sequence[int], start: int, last_n: int | None = 1, hidden: bool = False) -> Pass:
        """A forward pass of `ids` at `start` up to its first layer (the embedding), to be
        continued with `run_layers` and finished with `end`; no graph replay."""
        t = len(ids)
        if start + t > self.n_ctx:
            raise ContextOverflowError(start + t, self.n_ctx)
        x = self.embed(ids)
        keep = t if hidden or last_n is None else max(1, min(last_n, t))
        return Pass(x=x, t=t, start=start, keep=keep, hidden=hidden)

    def embed(self, ids: Sequence[int]) -> Any:
        """The first layer's input for `ids` (host ids, or a device array on a device backend):
        their embedding rows [T, E], scaled where the model scales them."""
        s = self.spec
        idx = ids if hasattr(ids, "__cuda_array_interface__") else np.asarray(ids, dtype=np.int64)
        x = self.ops.embed_rows(self.embed_table, idx, s.n_embd)  # [T, E]
        if s.traits.embed_scale:
            x = x * np.float32(math.sqrt(s.n_embd))
        return x

    def begin_rows(self, x: Any, start: int) -> Pass:
        """A pass from first-layer rows `x` [T, E] (`embed`) at `start` that keeps every row and
        stops before the head (what a captured later chunk runs, `cupy_prefill_graph`)."""
        t = int(x.shape[0])
        if start + t > self.n_ctx:
            raise ContextOverflowError(start + t, self.n_ctx)
        return Pass(x=x, t=t, start=start, keep=t, hidden=True)

    def begin_replay(self, ids: Sequence[int], start: int, group: int) -> Pass | None:
        """`begin` for a later chunk the backend replays from graphs (`ops.prefill_graphs.later`,
        CuPy: captured now where due), in pieces of `group` layers (0: whole) as `run_layers`
        asks for them; logits of the last row only. None: run it eagerly (`begin`)."""
        graphs = self.ops.prefill_graphs
        if graphs is None or start + len(ids) > self.n_ctx:
            return None
        replay = graphs.later(self, ids, start, group)
        if replay is None:
            return None
        replay.load(self, ids)
        return Pass(x=None, t=len(ids), start=start, keep=1, hidden=False, replay=replay)

    def run_layers(self, p: Pass, lo: int, hi: int) -> None:
        """Layers lo..hi-1 of pass `p` (they must follow the layers it has run)."""
        if lo != p.layer:
            raise ValueError(f"pass is at layer {p.layer}, not {lo}")
        if p.replay is not None:
            p.replay.launch(lo, hi)
            p.layer = min(hi, len(self.layers))
            return
        for i in range(lo, min(hi, len(self.layers))):
            p.x = self._layer(i, p)
            p.layer = i + 1

    def end(self, p: Pass) -> Any:
        """The pass's result once every layer ran: logits of its last `keep` rows, or hidden."""
        if p.layer != len(self.layers):
            raise ValueError(f"pass stopped at layer {p.layer} of {len(self.layers)}")
        if p.replay is not None:
            return self.head(p.replay.row)
        return p.x if p.hidden else self.head(p.x)

    def _layer(self, i: int, p: Pass) -> Any:
        """Block i on the pass's x [T, E]: K/V into the cache; returns the block's output."""
        s, ops, lw, t, start, keep = self.spec, self.ops, self.layers[i], p.t, p.start, p.keep
        x, p.x = p.x, None  # the input is dropped once used (a chunk's peak stays one step's)
        hd, vd, nh, nkv = s.head_dim, s.v_head_dim, s.n_heads, s.n_kv_heads
        last_layer = len(self.layers) - 1 if keep < t else -1
        h = ops.rms_norm(x, lw.attn_norm, s.norm_eps)
        qkv = ops.linear(h, lw.wqkv, lw.bqkv, lw.aq["qkv"])  # [T, (H + KV) * D + KV * Dv]
        q = qkv[:, : nh * hd].reshape(t, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(t, nkv, hd)
        v = qkv[:, (nh + nkv) * hd :].reshape(t, nkv, vd)
        cos, sin = self.rope[s.layer_rope_base(i)]
        cos, sin, style = cos[start : start + t], sin[start : start + t], s.traits.rope_style
        q = ops.norm_rope(q, lw.q_norm, s.norm_eps, cos, sin, style)  # Q/K norm (where the model has it), RoPE
        k = ops.norm_rope(k, lw.k_norm, s.norm_eps, cos, sin, style)
        ops.kv_store(self.kv.k[i], start, k)
        ops.kv_store(self.kv.v[i], start, v)
        window = s.sliding_window if s.is_swa_layer(i) else 0
        scale = s.attn_scale
        if s.traits.scale_q:
            q, scale = q * np.float32(scale), 1.0
        a = ops.attention(q, self.kv.k[i], self.kv.v[i], start, window, scale)  # [T, H*Dv]
        del qkv, q, k, v, h  # each intermediate is dropped once used: a chunk's peak stays one step's
        a = ops.linear(a, lw.wo, None, lw.aq["o"])  # [T, E]
        if i == last_layer:  # only the rows whose logits are wanted go on (llama.cpp's inp_out_ids)
            a, x = a[-keep:], x[-keep:]
        if lw.post_attn_norm is not None:
            a = ops.rms_norm(a, lw.post_attn_norm, s.norm_eps)
        x = x + a
        h = ops.rms_norm(x, lw.ffn_norm, s.norm_eps)
        gu = ops.linear(h, lw.w_gate_up, None, lw.aq["gate_up"])  # [T, 2F]
        act = ops.gated_act(gu[:, : s.n_ff], gu[:, s.n_ff :], s.traits.activation)
        del gu, h
        f = ops.linear(act, lw.w_down, None, lw.aq["down"])
        del act
        if lw.post_ffn_norm is not None:
            f = ops.rms_norm(f, lw.post_ffn_norm, s.norm_eps)
        x = x + f
        del a, f
        return x

    def head(self, x: Any) -> Any:
        """Logits [n, vocab] of last-layer outputs x [n, E]: output norm, then the output matrix."""
        x = self.ops.rms_norm(x, self.output_norm, self.spec.norm_eps)
        return self.ops.linear(x, self.output, None, self.output_aq)


def _arrays(layers: list[LayerWeights]) -> list[Any]:
    out: list[Any] = []
    for lw in layers:
        out.extend(a for a in vars(lw).values() if a is not None and hasattr(a, "nbytes"))
    return out
