"""Bad model files and bad templates give clear errors that name what is wrong."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine import ModelFormatError, TemplateError, load_model
from engine.chat_template import render_chat
from engine.gguf_file import read_gguf
from genie_supervisor.cli import main
from tests.models import SMOLLM2, require


def _write(path: Path, arch: str, tensor_type: gguf.GGMLQuantizationType | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_uint32(f"{arch}.embedding_length", 32)
    w.add_uint32(f"{arch}.attention.head_count", 2)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32(f"{arch}.feed_forward_length", 64)
    data = np.zeros((8, 32), dtype=np.float32)
    if tensor_type is None:
        w.add_tensor("token_embd.weight", data)
    else:  # raw bytes of a type the engine does not support
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        raw = np.zeros((8, size), dtype=np.uint8)  # one block per row
        w.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_wrong_magic_is_named(tmp_path: Path) -> None:
    """A file that is not GGUF is refused by its magic."""
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ModelFormatError) as exc:
        load_model(p)
    assert exc.value.key == "magic"
    assert "not a GGUF" in str(exc.value)


def test_truncated_file_is_named(tmp_path: Path) -> None:
    """A GGUF cut short is refused as truncated, naming where it ends."""
    src = require(SMOLLM2)
    p = tmp_path / "cut.gguf"
    with open(src, "rb") as fin, open(p, "wb") as fout:
        fout.write(fin.read(5_000_000))
    with pytest.raises(ModelFormatError, match="truncated"):
        load_model(p)
    q = tmp_path / "cut_header.gguf"
    with open(src, "rb") as fin, open(q, "wb") as fout:
        fout.write(fin.read(1000))
    with pytest.raises(ModelFormatError, match="truncated"):
        read_gguf(q)


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    """An architecture the engine does not know is refused by name."""
    p = _write(tmp_path / "m.gguf", "mamba")
    with pytest.raises(ModelFormatError) as exc:
        load_model(p)
    assert exc.value.key == "general.architecture"
    assert "'mamba'" in str(exc.value)


def test_missing_key_is_named(tmp_path: Path) -> None:
    """A missing required metadata key is named."""
    p = _write(tmp_path / "m.gguf", "llama")
    with pytest.raises(ModelFormatError) as exc:
        load_model(p)
    assert exc.value.key.startswith("llama.") or exc.value.key.startswith("tokenizer")


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    """A tensor stored in a type the engine cannot compute with is named with its type."""
    p = _write(tmp_path / "m.gguf", "llama", gguf.GGMLQuantizationType.Q2_K)
    from engine.model import _check_types

    with pytest.raises(ModelFormatError) as exc:
        _check_types(read_gguf(p))
    assert exc.value.key == "token_embd.weight"
    assert "Q2_K" in str(exc.value)


def test_cli_prints_one_line_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`chat` on a bad file exits 1 with one error line, no traceback."""
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"nope")
    assert main(["chat", "-m", str(p), "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert "magic" in err and "Traceback" not in err


def test_template_cannot_reach_python_internals() -> None:
    """A chat template that walks to Python internals raises TemplateError instead of running."""
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        render_chat(evil, [{"role": "user", "content": "hi"}])
    evil2 = "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
    with pytest.raises(TemplateError):
        render_chat(evil2, [{"role": "user", "content": "hi"}])


def test_copy_of_real_model_loads(tmp_path: Path) -> None:
    """A byte-identical copy of the real model loads (the checks above are not over-eager)."""
    src = require(SMOLLM2)
    p = tmp_path / "copy.gguf"
    shutil.copy(src, p)
    gf = read_gguf(p)
    assert gf.get("general.architecture") == "llama"
