"""Architecture table: what differs between the model families, as explicit options.

One entry per supported `general.architecture`; anything else is refused by name (as llama.cpp
does). The forward pass in `model.py` reads only `ModelSpec`, never the architecture string.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .errors import ModelFormatError, cap_text
from .gguf_file import GGUFFile

RopeStyle = Literal["interleaved", "neox"]
Activation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class ArchTraits:
    """Per-architecture choices that the GGUF metadata does not spell out."""

    rope_style: RopeStyle
    """``interleaved`` rotates pairs (2i, 2i+1) (ggml mode 0, llama: Q/K were permuted at
    conversion); ``neox`` rotates (i, i + d/2)."""
    activation: Activation
    """Gate activation of the gated FFN: SwiGLU (``silu``) or GeGLU (``gelu_tanh``)."""
    qk_norm: bool = False
    """RMSNorm over each head of Q and K before RoPE (qwen3, gemma3)."""
    post_norms: bool = False
    """Extra RMSNorm on the attention and FFN outputs before the residual add (gemma3)."""
    embed_scale: bool = False
    """Multiply embeddings by sqrt(hidden size) (gemma family)."""
    sliding_window_pattern: int = 0
    """Every n-th layer is global, the others use the sliding window (gemma3: 6); 0 = none."""
    local_rope_base: float | None = None
    """RoPE base of the sliding-window layers (gemma3: 10000); None = same as global."""
    scale_q: bool = False
    """Multiply Q by the attention scale before attention, which then scales by 1 (gemma3, as
    llama.cpp's graph does: the rounding of Q to fp16 in its flash attention sees the scaled Q)."""


ARCHITECTURES: dict[str, ArchTraits] = {
    "llama": ArchTraits(rope_style="interleaved", activation="silu"),
    "qwen2": ArchTraits(rope_style="neox", activation="silu"),
    "qwen3": ArchTraits(rope_style="neox", activation="silu", qk_norm=True),
    "gemma3": ArchTraits(
        rope_style="neox",
        activation="gelu_tanh",
        qk_norm=True,
        post_norms=True,
        embed_scale=True,
        sliding_window_pattern=6,
        local_rope_base=10000.0,
        scale_q=True,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and options of one model, read from GGUF metadata."""

    arch: str
    """``general.architecture``."""
    name: str
    """``general.name`` (or the file name)."""
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    """Dimension of one Q/K head."""
    v_head_dim: int
    """Dimension of one V head."""
    n_vocab: int
    n_ctx_train: int
    """Context length the model was trained for."""
    norm_eps: float
    rope_base: float
    rope_dim: int
    """How many dimensions of each head RoPE rotates."""
    rope_scale: float
    """Linear RoPE position scale factor (1.0 = none)."""
    attn_scale: float
    """Scale applied to Q·K (1/sqrt(head_dim), or gemma3's query_pre_attn_scalar)."""
    sliding_window: int
    """Tokens a sliding-window layer sees (0 = all layers global)."""
    traits: ArchTraits

    def is_swa_layer(self, layer: int) -> bool:
        p = self.traits.sliding_window_pattern
        return bool(self.sliding_window) and p > 0 and (layer % p) < p - 1

    def layer_rope_base(self, layer: int) -> float:
        if self.is_swa_layer(layer) and self.traits.local_rope_base is not None:
            return self.traits.local_rope_base
        return self.rope_base


def read_spec(gf: GGUFFile) -> ModelSpec:
    """Build the spec; raise ModelFormatError naming an unknown architecture or a missing key."""
    arch = gf.get("general.architecture")
    if arch is None:
        raise ModelFormatError(gf.path, "general.architecture", "required metadata key is missing")
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ModelFormatError(
            gf.path, "general.architecture", f"unknown architecture {cap_text(repr(arch), 80)} (supported: {known})"
        )
    traits = ARCHITECTURES[arch]

    def key(k: str) -> str:
        return f"{arch}.{k}"

    dim = float(1 << 20)  # no real model has a dimension near a million
    n_embd = gf.number(key("embedding_length"), lo=1, hi=dim)
    n_heads = gf.number(key("attention.head_count"), lo=1, hi=4096)
    n_kv = gf.number(key("attention.head_count_kv"), n_heads, lo=1, hi=4096)
    head_dim = gf.number(key("attention.key_length"), max(n_embd // n_heads, 1), lo=1, hi=65536)
    v_head_dim = gf.number(key("attention.value_length"), head_dim, lo=1, hi=65536)
    emb = gf.tensors.get("token_embd.weight")
    if emb is None:
        raise ModelFormatError(gf.path, "token_embd.weight", "required tensor is missing")
    if len(emb.shape) != 2:
        raise ModelFormatError(gf.path, "token_embd.weight", f"expected 2 dimensions, found shape {emb.shape}")
    n_vocab = gf.number(key("vocab_size"), emb.shape[0], lo=1, hi=float(1 << 24))
    eps = gf.number(key("attention.layer_norm_rms_epsilon"), integer=False, lo=0, hi=1)
    n_layers = gf.number(key("block_count"), lo=1, hi=4096)
    rope_scale = 1.0
    if gf.get(key("rope.scaling.type"), "none") == "linear":
        rope_scale = gf.number(key("rope.scaling.factor"), 1.0, integer=False, lo=0, hi=1e6) or 1.0
    attn_scale = 1.0 / math.sqrt(head_dim)
    if arch == "gemma3" and n_layers == 62:
        # gemma3 27B's query_pre_attn_scalar is n_embd / n_heads, not head_dim (llama.cpp: LLM_TYPE_27B)
        attn_scale = 1.0 / math.sqrt(n_embd / n_heads)
    if n_heads % n_kv:
        raise ModelFormatError(gf.path, key("attention.head_count_kv"), f"{n_heads} heads not divisible by {n_kv}")
    return ModelSpec(
        arch=arch,
        name=cap_text(str(gf.get("general.name", gf.path.rsplit("/", 1)[-1]))),
        n_layers=n_layers,
        n_embd=n_embd,
        n_ff=gf.number(key("feed_forward_length"), lo=1, hi=dim),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        n_vocab=n_vocab,
        n_ctx_train=gf.number(key("context_length"), 2048, lo=1, hi=float(1 << 24)),
        norm_eps=eps,
        rope_base=gf.number(key("rope.freq_base"), 10000.0, integer=False, lo=1, hi=1e12),
        rope_dim=gf.number(key("rope.dimension_count"), head_dim, lo=0, hi=head_dim),
        rope_scale=rope_scale,
        attn_scale=attn_scale,
        sliding_window=gf.number(key("attention.sliding_window"), 0, lo=0, hi=float(1 << 24)),
        traits=traits,
    )
