"""The one-token decode step as a list of kernel launches (`CupyDecoder.plan`), in order:
embedding; per layer norm+rounding+QKV GEMV, Q/K norm+RoPE+KV write (`qkv_post`), split attention
and merge (`attn_decode`), output GEMV + residual, norm+rounding+gate/up GEMV + SwiGLU/GeGLU, down
GEMV + residual; final norm + head GEMV; argmax. Every launch's arguments are the decoder's fixed
buffers (token and position are read from `ids` on the device), so the list replays as one graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import cupy as cp
import numpy as np

from ..kv_cache import Int8Rows
from .cupy_gemv import Launch, gemv_launches, ptr, rounds_input
from .cupy_plan import ARGMAX_BLOCKS

if TYPE_CHECKING:
    from .cupy_decoder import CupyDecoder


def _cache_arrays(layer: Any) -> tuple[Any, Any]:
    """(values, int8 scales or None) of one layer's K or V cache."""
    if isinstance(layer, Int8Rows):
        return layer.q, layer.d
    return layer, None


def step_launches(decoder: CupyDecoder, long: bool = False) -> list[Launch]:
    """The launches of `decoder`'s step, on its buffers and kernels (`CupyDecoder.function`);
    `long`: past `decoder.long_from` attended positions (`CupyDecoder.plan_long`), where the layers
    whose window does not keep the context within one cluster run the plain attention kernel."""
    return _Step(decoder, long).build()


class _Step:
    """Builds one decoder's launch list (`build`)."""

    def __init__(self, decoder: CupyDecoder, long: bool = False) -> None:
        self.d = decoder
        self.long = long
        self.plan: list[Launch] = []

    def build(self) -> list[Launch]:
        """Embedding, the layers, final norm + head, argmax: the whole step in launch order."""
        d = self.d
        tf, s = d.tf, d.spec
        eps = np.float32(s.norm_eps)
        e, nh, nkv = s.n_embd, s.n_heads, s.n_kv_heads
        if not d.host_embed:
            t = tf.embed_table
            self.plan.append(
                Launch(
                    d.function(f"embed_{t.type_name}"),
                    (-(-(e // 32) // 128),),
                    (128,),
                    (t.raw, np.int64(t.raw.shape[1]), d.ids, d.x, np.int32(e), d.embed_scale),
                    0,
                    "embed",
                )
            )
        for i, lw in enumerate(tf.layers):
            (kc, kd), (vc, vd) = _cache_arrays(tf.kv.k[i]), _cache_arrays(tf.kv.v[i])
            cache = (kc, vc, ptr(kd), ptr(vd), d.ids)  # the layer's K/V cache and scales, token + position
            cos, sin = tf.rope[s.layer_rope_base(i)]
            self.gemv(lw.wqkv, d.x, lw.attn_norm, lw.aq["qkv"], d.qkv, lw.bqkv)
            post_args = (d.qkv, d.q, *cache, cos, sin, ptr(lw.q_norm), ptr(lw.k_norm), np.int32(d.n_ctx), eps)
            self.plan.append(Launch(d.function("qkv_post"), (nh + 2 * nkv,), (128,), post_args, 0, "qkv_post"))
            window = s.sliding_window if s.is_swa_layer(i) else 0
            # attention's last block per KV head also rounds its heads for the output projection
            o_round = rounds_input(lw.wo, lw.aq["o"], (nh // nkv) * s.v_head_dim)
            plain = self.long and not 0 < window <= d.long_from  # a window may keep it in one cluster
            self.plan.append(
                Launch(
                    d.function("attn_decode", long=plain),
                    (nkv, d.n_split if plain else d.attn_blocks),
                    (32 * (d.long_warps if plain else d.attn_warps),),
                    (
                        d.q,
                        *cache,
                        d.pm,
                        d.pl,
                        d.pacc,
                        d.counters,
                        d.attn,
                        np.int32(d.n_ctx),
                        np.int32(window),
                        np.float32(s.attn_scale),
                        np.int32(o_round),
                        d.qin.xq,
                        d.qin.xd,
                        d.qin.xs16,
                    ),
                    0,
                    "attn",
                )
            )
            self.residual(lw.wo, d.attn, lw.aq["o"], lw.post_attn_norm, input_ready=o_round > 0)
            gelu = s.traits.activation != "silu"
            if lw.w_gate_up.raw is not None:  # gate and up share a type: one pass, fused GLU
                self.gemv(
                    lw.w_gate_up, d.x, lw.ffn_norm, lw.aq["gate_up"], d.act, epi=3 if gelu else 2, out_rows=s.n_ff
                )
            else:
                self.gemv(lw.w_gate_up, d.x, lw.ffn_norm, lw.aq["gate_up"], d.gu)
                self.plan.append(
                    Launch(
                        d.function("glu"),
                        (-(-s.n_ff // 256),),
                        (256,),
                        (d.gu, d.act, np.int32(s.n_ff), np.int32(gelu)),
                        0,
                        "glu",
                    )
                )
            self.residual(lw.w_down, d.act, lw.aq["down"], lw.post_ffn_norm)
        self.gemv(tf.output, d.x, tf.output_norm, tf.output_aq, d.out_logits)
        self.plan.append(
            Launch(
                d.function("argmax_ids"),
                (ARGMAX_BLOCKS,),
                (512,),
                (
                    d.out_logits,
                    np.int32(d.out_logits.size),
                    d.best_v,
                    d.best_i,
                    d.counters[nkv:],
                    d.ids,
                ),
                0,
                "argmax",
            )
        )
        return self.plan

    def gemv(
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
        `input_ready`: x was already rounded into `d.qin` by the launch before."""
        d = self.d
        self.plan.extend(
            gemv_launches(
                d.function,
                d.n_sm,
                w,
                x,
                nw,
                np.float32(d.spec.norm_eps),
                aq,
                y,
                bias,
                epi,
                out_rows,
                d.qin,
                input_ready,
                budget=d.row_budget,
            )
        )

    def residual(
        self,
        w: Any,
        inp: cp.ndarray,
        aq: str | None,
        post_norm: cp.ndarray | None,
        input_ready: bool = False,
    ) -> None:
        """x += W @ inp, or x += rms_norm(W @ inp) * post_norm (gemma3); `input_ready` as in `gemv`."""
        d = self.d
        if post_norm is None:
            self.gemv(w, inp, None, aq, d.x, epi=1, input_ready=input_ready)
            return
        self.gemv(w, inp, None, aq, d.tmp, input_ready=input_ready)
        self.plan.append(
            Launch(
                d.function("add_rmsnorm"),
                (1,),
                (256,),
                (d.x, d.tmp, post_norm, np.int32(d.spec.n_embd), np.float32(d.spec.norm_eps)),
                0,
                "add_rmsnorm",
            )
        )
