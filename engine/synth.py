"""Synthetic GGUF models (random weights, tiny byte-level BPE vocabulary) for tests and benchmarks.

    from engine.synth import write_synthetic_gguf
    write_synthetic_gguf("tiny.gguf", "qwen3", n_layers=2, n_embd=64, n_ff=128, n_heads=4,
                         n_kv_heads=2, n_vocab=300, weight_type="Q4_K")

CLI: ``python -m engine.synth OUT.gguf --preset qwen3-4b-q4_k_m`` (see PRESETS).

Weights are drawn at scales that keep activations and logits in a useful range (matrices
N(0, 1/in), norm weights near 1), then encoded with `engine.quants_encode`. `fast=True` writes
valid random blocks directly (no float weights: seconds for a 4B-shaped model).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from .quants import dequantize
from .quants_encode import quantize, random_blocks
from .tokenizer_bpe import BYTE_TO_UNICODE

ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
MERGES = ["Ġ t", "Ġ a", "h e", "i n", "Ġt he", "Ġ s", "e r", "o n"]
CONTROL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5


def vocabulary(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges of a byte-level BPE vocabulary padded to `n_vocab`."""
    tokens = list(BYTE_TO_UNICODE)
    tokens += [m.replace(" ", "") for m in MERGES]
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += CONTROL_TOKENS
    types += [TOKEN_CONTROL] * len(CONTROL_TOKENS)
    if n_vocab < len(tokens):
        raise ValueError(f"n_vocab must be >= {len(tokens)} (256 bytes, merges, control tokens)")
    pad = n_vocab - len(tokens)
    tokens += [f"<unused{i}>" for i in range(pad)]
    types += [TOKEN_UNUSED] * pad
    return tokens, types, list(MERGES)


def q4_k_m_types(n_layers: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M mix: Q6_K for the head and for attn_v/ffn_down of some layers, else Q4_K."""

    def more_bits(i: int) -> bool:
        return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2

    mix = {"token_embd.weight": "Q6_K", "output.weight": "Q6_K"}
    for i in range(n_layers):
        kind = "Q6_K" if more_bits(i) else "Q4_K"
        mix[f"blk.{i}.attn_v.weight"] = kind
        mix[f"blk.{i}.ffn_down.weight"] = kind
    return mix


@dataclass(frozen=True)
class SynthConfig:
    """Shape and encoding of a synthetic model (see write_synthetic_gguf)."""

    arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    n_vocab: int
    head_dim: int | None = None
    weight_type: str = "Q4_1"
    type_overrides: Mapping[str, str] = field(default_factory=dict)
    tied: bool = True
    seed: int = 0
    sliding_window: int | None = None
    n_ctx_train: int = 4096
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    fast: bool = False
    dequantized: bool = False
    name: str = "synthetic"


def _preset(
    arch: str,
    layers: int,
    embd: int,
    ff: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    weights: str,
    n_ctx_train: int,
    rope_base: float,
    name: str,
    **more: object,
) -> dict[str, object]:
    """The SynthConfig keywords of a named shape, tied; weights ``Q4_K_M``: Q4_K with llama.cpp's
    Q4_K_M mix (``mix="q4_k_m"``, see `preset_config`); `more`: head_dim, norm_eps, ..."""
    if weights == "Q4_K_M":
        weights, more = "Q4_K", {**more, "mix": "q4_k_m"}
    shape = dict(n_layers=layers, n_embd=embd, n_ff=ff, n_heads=heads, n_kv_heads=kv_heads, n_vocab=vocab)
    rope = dict(n_ctx_train=n_ctx_train, rope_base=rope_base)
    return {"arch": arch, **shape, "weight_type": weights, "tied": True, **rope, "name": name, **more}


# fmt: off
PRESETS: dict[str, dict[str, object]] = {
    # _preset(arch, layers, embd, ff, heads, kv heads, vocab, weights, n_ctx_train, rope base, name, **more)
    "smollm2-135m-q4_1": _preset("llama", 30, 576, 1536, 9, 3, 49152, "Q4_1", 8192, 1e5, "SmolLM2-135M-shape",
                                 norm_eps=1e-5),
    "qwen3-4b-q4_k_m": _preset("qwen3", 36, 2560, 9728, 32, 8, 151936, "Q4_K_M", 40960, 1e6, "Qwen3-4B-shape",
                               head_dim=128),
    "qwen2-0.5b-q8_0": _preset("qwen2", 24, 896, 4864, 14, 2, 151936, "Q8_0", 32768, 1e6, "Qwen2-0.5B-shape"),
    "gemma3-270m-q4_k_m": _preset("gemma3", 18, 640, 2048, 4, 1, 262144, "Q4_K_M", 32768, 1e6, "Gemma3-270M-shape",
                                  head_dim=256, sliding_window=512),
}
# fmt: on
"""Real models' shapes (``mix="q4_k_m"``: llama.cpp's Q4_K_M type table, see `preset_config`)."""

TINY_SHAPE: Mapping[str, int] = dict(n_layers=2, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, n_vocab=512)
"""A small shape for tests (``write_synthetic_gguf(path, arch, **{**TINY_SHAPE, "n_layers": 3})``)
and the CLI's defaults."""


def preset_config(name: str, **overrides: object) -> SynthConfig:
    """A SynthConfig from PRESETS (``mix="q4_k_m"`` becomes the per-tensor type table)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    kw = {**PRESETS[name], **overrides}
    mix = kw.pop("mix", None)
    if mix == "q4_k_m":
        kw["type_overrides"] = q4_k_m_types(int(kw["n_layers"]))  # type: ignore[call-overload]
    return SynthConfig(**kw)  # type: ignore[arg-type]


def _tensor_list(c: SynthConfig) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor; kind: matrix, norm, bias, embed."""
    hd = c.head_dim or c.n_embd // c.n_heads
    e, q, kv = c.n_embd, c.n_heads * hd, c.n_kv_heads * hd
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (c.n_vocab, e), "embed")]
    for i in range(c.n_layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (e,), "norm"),
            (p + "attn_q.weight", (q, e), "matrix"),
            (p + "attn_k.weight", (kv, e), "matrix"),
            (p + "attn_v.weight", (kv, e), "matrix"),
        ]
        if c.arch == "qwen2":
            out += [
                (p + "attn_q.bias", (q,), "bias"),
                (p + "attn_k.bias", (kv,), "bias"),
                (p + "attn_v.bias", (kv,), "bias"),
            ]
        if c.arch in ("qwen3", "gemma3"):
            out += [(p + "attn_q_norm.weight", (hd,), "norm"), (p + "attn_k_norm.weight", (hd,), "norm")]
        out.append((p + "attn_output.weight", (e, q), "matrix"))
        if c.arch == "gemma3":
            out.append((p + "post_attention_norm.weight", (e,), "norm"))
        out += [
            (p + "ffn_norm.weight", (e,), "norm"),
            (p + "ffn_gate.weight", (c.n_ff, e), "matrix"),
            (p + "ffn_up.weight", (c.n_ff, e), "matrix"),
            (p + "ffn_down.weight", (e, c.n_ff), "matrix"),
        ]
        if c.arch == "gemma3":
            out.append((p + "post_ffw_norm.weight", (e,), "norm"))
    out.append(("output_norm.weight", (e,), "norm"))
    if not c.tied:
        out.append(("output.weight", (c.n_vocab, e), "embed"))
    return out


def _std(kind: str, shape: tuple[int, ...]) -> float:
    if kind == "embed":
        return 3.0 / np.sqrt(shape[-1])  # logits = normed hidden . row: std ~3
    if kind == "bias":
        return 0.1
    return 1.0 / np.sqrt(shape[-1])


def _encode(
    c: SynthConfig, rng: np.random.Generator, name: str, shape: tuple[int, ...], kind: str
) -> tuple[np.ndarray, str]:
    """Bytes and type of one tensor (1-D tensors are always F32, as llama.cpp writes them)."""
    if kind in ("norm", "bias"):
        if kind == "norm":
            w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            w = _std(kind, shape) * rng.standard_normal(shape, dtype=np.float32)
        return w.astype(np.float32), "F32"
    t = c.type_overrides.get(name, c.weight_type)
    std = _std(kind, shape)
    if c.fast:
        raw = random_blocks(rng, t, shape[0], shape[1], std)
    else:
        raw = quantize(rng.standard_normal(shape, dtype=np.float32) * np.float32(std), t)
    if c.dequantized:
        view = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(t)
        return dequantize(raw.view(view) if view else raw, t, shape), "F32"
    return raw, t


def write_synthetic_gguf(
    path: str | os.PathLike[str],
    arch: str = "llama",
    *,
    n_layers: int,
    n_embd: int,
    n_ff: int,
    n_heads: int,
    n_kv_heads: int,
    n_vocab: int,
    head_dim: int | None = None,
    weight_type: str = "Q4_1",
    type_overrides: Mapping[str, str] | None = None,
    tied: bool = True,
    seed: int = 0,
    sliding_window: int | None = None,
    n_ctx_train: int = 4096,
    rope_base: float = 10000.0,
    norm_eps: float = 1e-6,
    fast: bool = False,
    dequantized: bool = False,
    name: str = "synthetic",
    raw_tensors: Mapping[str, tuple[np.ndarray, str]] | None = None,
) -> str:
    """Write a random model of `arch` to `path` and return the path.

    `weight_type` encodes every 2-D tensor (norms and biases stay F32); `type_overrides` maps
    tensor names to other types (e.g. `q4_k_m_types(n_layers)`). `dequantized=True` writes the
    same weights (same seed) decoded back to F32: the float twin of a quantized model.
    `raw_tensors` replaces tensors by (bytes, type name) as given, for format tests.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (known: {', '.join(ARCHS)})")
    c = SynthConfig(
        arch=arch,
        n_layers=n_layers,
        n_embd=n_embd,
        n_ff=n_ff,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        n_vocab=n_vocab,
        head_dim=head_dim,
        weight_type=weight_type,
        type_overrides=dict(type_overrides or {}),
        tied=tied,
        seed=seed,
        sliding_window=sliding_window,
        n_ctx_train=n_ctx_train,
        rope_base=rope_base,
        norm_eps=norm_eps,
        fast=fast,
        dequantized=dequantized,
        name=name,
    )
    return write_config(path, c, raw_tensors)


def write_config(
    path: str | os.PathLike[str],
    c: SynthConfig,
    raw_tensors: Mapping[str, tuple[np.ndarray, str]] | None = None,
    log: Callable[[str], None] | None = None,
    header_only: bool = False,
) -> str:
    """Write the model described by `c` (see write_synthetic_gguf); `header_only`: the same file
    cut after its header (metadata and tensor infos, no tensor byte), for planning tests."""
    p = os.fspath(path)
    hd = c.head_dim or c.n_embd // c.n_heads
    w = GGUFWriter(p, c.arch)
    w.add_name(c.name)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.n_ctx_train)
    w.add_embedding_length(c.n_embd)
    w.add_feed_forward_length(c.n_ff)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    if c.head_dim is not None:
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_freq_base(c.rope_base)
    if c.arch == "gemma3":
        w.add_sliding_window(c.sliding_window if c.sliding_window is not None else 512)
    tokens, types, merges = vocabulary(c.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(c.seed)
    if header_only:
        for name, shape, kind in _tensor_list(c):
            t = "F32" if kind in ("norm", "bias") or c.dequantized else c.type_overrides.get(name, c.weight_type)
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
            nbytes = math.prod(shape) // block * size
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=GGMLQuantizationType[t])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        return p
    for name, shape, kind in _tensor_list(c):
        if raw_tensors and name in raw_tensors:
            data, t = raw_tensors[name]
            rng.standard_normal(1)  # keep the stream of the other tensors unchanged
        else:
            data, t = _encode(c, rng, name, shape, kind)
        if log is not None:
            log(f"{name} {t} {shape}")
        if t == "F32" and data.dtype == np.float32:
            w.add_tensor(name, np.ascontiguousarray(data.reshape(shape)))
        else:
            w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=GGMLQuantizationType[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


_SHAPE_FLAGS = (("--layers", "n_layers"), ("--embd", "n_embd"), ("--ff", "n_ff"), ("--heads", "n_heads"),
               ("--kv-heads", "n_kv_heads"), ("--vocab", "n_vocab"))  # fmt: skip
"""The CLI's shape options and the SynthConfig fields they set."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.synth", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a named shape (overrides --arch etc.)")
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    for flag, key in _SHAPE_FLAGS:
        ap.add_argument(flag, dest=key, metavar=flag[2:].upper().replace("-", "_"), type=int, default=TINY_SHAPE[key])
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--type", default=None, help="weight type (F32 F16 BF16 Q8_0 Q4_0 ... Q6_K)")
    ap.add_argument("--untied", action="store_true", help="write a separate output.weight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fast", action="store_true", help="random blocks instead of encoded floats")
    a = ap.parse_args(argv)
    if a.preset:
        over: dict[str, object] = {"seed": a.seed, "fast": a.fast}
        if a.type:
            over["weight_type"] = a.type
        if a.untied:
            over["tied"] = False
        cfg = preset_config(a.preset, **over)
        if a.arch != "llama" and a.arch != cfg.arch:
            ap.error(f"--arch {a.arch} contradicts preset {a.preset} ({cfg.arch})")
    else:
        shape = {key: getattr(a, key) for _, key in _SHAPE_FLAGS}
        tied, kind = not a.untied, a.type or "Q4_1"
        cfg = SynthConfig(a.arch, **shape, head_dim=a.head_dim, weight_type=kind, tied=tied, seed=a.seed, fast=a.fast)
    write_config(a.out, cfg)
    print(f"{a.out}: {cfg.arch} {cfg.n_layers} layers, {os.path.getsize(a.out) / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
