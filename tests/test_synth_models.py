"""Synthetic GGUF models: every architecture and tensor type loads and computes sane logits (CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import load_model
from engine.errors import ModelFormatError
from engine.quants import dequantize
from engine.quants_encode import quantize, random_blocks
from engine.synth import q4_k_m_types, write_synthetic_gguf

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
SHAPE = dict(n_layers=2, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, n_vocab=300)
IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 264, 265, 33, 10, 72]


def _view(raw: np.ndarray, t: str) -> np.ndarray:
    return raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(t, np.uint8))


@pytest.mark.parametrize("t", TYPES)
def test_encoders_round_trip(t: str) -> None:
    """Each encoder's bytes decode (engine.quants) back to the input within the type's precision."""
    x = np.random.default_rng(1).standard_normal((5, 512)).astype(np.float32)
    y = dequantize(_view(quantize(x, t), t), t, x.shape)
    err = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert err < {"Q4_0": 0.12, "Q4_1": 0.12, "Q4_K": 0.12}.get(t, 0.06), err
    r = dequantize(_view(random_blocks(np.random.default_rng(2), t, 5, 512, 0.5), t), t, x.shape)
    assert np.isfinite(r).all() and 0.2 < r.std() < 1.5


@pytest.mark.parametrize(
    "arch,extra",
    [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 128}), ("gemma3", {"sliding_window": 4})],
)
def test_each_architecture_loads_and_gives_finite_logits(tmp_path: Path, arch: str, extra: dict) -> None:
    p = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch, weight_type="Q8_0", **SHAPE, **extra)
    m = load_model(p, backend="numpy", n_ctx=64)
    assert m.spec.arch == arch
    if arch == "gemma3":
        assert m.spec.sliding_window == 4 and m.spec.traits.post_norms
    if arch == "qwen2":
        assert m.transformer.layers[0].bqkv is not None
    ids = m.tokenizer.encode("hello the world<|im_end|>", parse_special=True)
    assert ids[-1] == m.tokenizer.eos_id
    logits = m.logits(IDS)
    assert logits.shape == (len(IDS), SHAPE["n_vocab"])
    assert np.isfinite(logits).all()
    assert 1.0 < float(logits.std()) < 10.0  # not degenerate


@pytest.mark.parametrize("t", TYPES)
def test_quantized_logits_match_float_twin(tmp_path: Path, t: str) -> None:
    """A model of type t and the same weights decoded to F32 give nearly the same logits
    (they differ only by llama.cpp's activation rounding)."""
    a = load_model(
        write_synthetic_gguf(tmp_path / "q.gguf", "qwen3", weight_type=t, **SHAPE), backend="numpy", n_ctx=64
    )
    b = load_model(
        write_synthetic_gguf(tmp_path / "f.gguf", "qwen3", weight_type=t, dequantized=True, **SHAPE),
        backend="numpy",
        n_ctx=64,
    )
    la, lb = a.logits(IDS), b.logits(IDS)
    err = np.linalg.norm(la - lb) / np.linalg.norm(lb)
    assert err < 0.05, err


def test_q4_k_m_mix_and_untied_head(tmp_path: Path) -> None:
    mix = q4_k_m_types(SHAPE["n_layers"])
    p = write_synthetic_gguf(tmp_path / "m.gguf", "llama", weight_type="Q4_K", type_overrides=mix, tied=False, **SHAPE)
    m = load_model(p, backend="numpy", n_ctx=64)
    assert m.transformer.output is not m.transformer.embed_table
    from engine.gguf_file import read_gguf

    gf = read_gguf(p)
    assert gf.tensors["output.weight"].type_name == "Q6_K"
    assert gf.tensors["blk.1.attn_v.weight"].type_name == "Q6_K"  # last layer: more bits
    assert gf.tensors["blk.0.attn_q.weight"].type_name == "Q4_K"
    assert np.isfinite(m.logits(IDS[:4])).all()


def test_tied_and_untied_heads_differ(tmp_path: Path) -> None:
    tied = load_model(write_synthetic_gguf(tmp_path / "t.gguf", "llama", **SHAPE), backend="numpy")
    untied = load_model(write_synthetic_gguf(tmp_path / "u.gguf", "llama", tied=False, **SHAPE), backend="numpy")
    assert tied.transformer.output is tied.transformer.embed_table
    assert not np.allclose(tied.logits(IDS[:3]), untied.logits(IDS[:3]))


@pytest.mark.parametrize("t,nbytes", [("Q2_K", 84), ("IQ4_NL", 18)])
def test_unsupported_tensor_type_is_refused_by_name(tmp_path: Path, t: str, nbytes: int) -> None:
    block = 256 if t == "Q2_K" else 32
    raw = np.zeros((SHAPE["n_ff"], SHAPE["n_embd"] // block * nbytes), dtype=np.uint8)
    p = write_synthetic_gguf(tmp_path / "bad.gguf", "llama", raw_tensors={"blk.1.ffn_up.weight": (raw, t)}, **SHAPE)
    with pytest.raises(ModelFormatError) as err:
        load_model(p, backend="numpy")
    assert err.value.key == "blk.1.ffn_up.weight"
    assert t in str(err.value)


def test_unknown_architecture_is_refused_by_name(tmp_path: Path) -> None:
    p = write_synthetic_gguf(tmp_path / "a.gguf", "llama", **SHAPE)
    data = Path(p).read_bytes()
    # same length, so offsets stay valid: "llama" -> "lxama" in general.architecture and its keys
    Path(p).write_bytes(data.replace(b"llama", b"lxama"))
    with pytest.raises(ModelFormatError) as err:
        load_model(p, backend="numpy")
    assert "lxama" in str(err.value) and err.value.key == "general.architecture"


def test_the_engines_gguf_constants_agree_with_the_gguf_package() -> None:
    """The value types and ggml tensor types `engine.gguf_file` writes out (so a start does not
    import the `gguf` package) have the installed package's ids, names and block sizes wherever
    both define a type, and every type the engine computes with is there."""
    import gguf

    from engine import gguf_file

    assert {t.name: int(t) for t in gguf_file.GGUFValueType} == {t.name: int(t) for t in gguf.GGUFValueType}
    package = {int(t): (t.name, *size) for t, size in gguf.GGML_QUANT_SIZES.items()}
    both = package.keys() & gguf_file.GGML_TYPES.keys()
    assert {i: package[i] for i in both} == {i: gguf_file.GGML_TYPES[i] for i in both}
    assert gguf_file.SUPPORTED_TYPES <= {package[i][0] for i in both}
