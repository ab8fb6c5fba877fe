"""`genie-supervisor models plan`: a model's memory plan from its GGUF header alone, against the
profile's LLM budget (the shipped Orin profile, a Qwen3-4B-shaped Q4_K_M at 8,192 tokens INT8 KV)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.synth import preset_config, write_config
from genie_supervisor.cli import main

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]
ORIN_CONFIG = str(ROOT / "deploy/config/orin-nano-8gb.yaml")
ORIN_POLICY = str(ROOT / "policies/orin-nano-8gb.yaml")
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def qwen3_4b_header(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m engine.synth --preset qwen3-4b-q4_k_m` cut after its header: no tensor byte exists."""
    path = tmp_path_factory.mktemp("plan") / "qwen3-4b-q4_k_m.gguf"
    write_config(path, preset_config("qwen3-4b-q4_k_m", fast=True), header_only=True)
    return path


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = main(["models", "plan", *args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out) if out.strip() else {}


@pytest.mark.parametrize("backend", ["cupy", "native"])
def test_a_4b_q4_k_m_fits_the_orin_profile_at_8k_int8(
    qwen3_4b_header: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 4B shape at 8,192 tokens with INT8 KV fits the Orin profile's budget, with the numbers,
    planned from a file that holds its header and no tensor data at all."""
    assert qwen3_4b_header.stat().st_size < 8 * MiB  # 2.5 GB of weights are not there
    rc, p = plan(
        capsys, str(qwen3_4b_header), "--config", ORIN_CONFIG, "--policy", ORIN_POLICY,
        "--n-ctx", "8192", "--kv", "int8", "--backend", backend,
    )  # fmt: skip
    assert rc == 0 and p["fits"] is True
    assert (p["arch"], p["n_ctx"], p["kv_dtype"], p["prefill_chunk"], p["policy"]) == (
        "qwen3",
        8192,
        "int8",
        64,
        "orin-nano-8gb",
    )
    assert p["budget_mb"] == 3328
    assert p["weights_mb"] == pytest.approx(2375.9, abs=0.1)
    assert p["kv_mb"] == 612.0  # 36 layers x 8 KV heads x 128 x 2 x 8192 x 34/32 bytes
    assert p["total_mb"] == pytest.approx(p["weights_mb"] + p["kv_mb"] + p["scratch_mb"], abs=0.2)
    assert 0 < p["left_mb"] < 3328 - 3000 + 100
    if backend == "cupy":
        assert p["scratch_mb"] == pytest.approx(142.1, abs=0.1)  # with the later-chunk graphs' pool and rows (20.5)
        assert p["scratch_parts_mb"]["prefill_tiles"] == 0  # every matrix multiplied by mmq_h_<T>
        assert p["scratch_parts_mb"]["prefill_activations"] < 25  # 64-token chunks, not 512


def test_text_output_names_every_part(qwen3_4b_header: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json the plan prints weights, KV, scratch, the total against the budget and the verdict."""
    rc = main(["models", "plan", str(qwen3_4b_header), "--config", ORIN_CONFIG, "--policy", ORIN_POLICY])
    out = capsys.readouterr().out
    assert rc == 0
    assert "n_ctx 8192, int8 KV, prefill chunk 64 (policy 'orin-nano-8gb')" in out
    for word in ("weights", "KV", "scratch", "of the 3328 MiB LLM budget", "fits:"):
        assert word in out, word


def test_over_budget_exits_3_with_the_numbers(qwen3_4b_header: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The built-in policy's 2,560 MiB budget refuses the 4B shape at 8k f16: exit 3, by how much."""
    rc = main(["models", "plan", str(qwen3_4b_header), "--n-ctx", "8192", "--kv", "f16", "--backend", "cupy"])
    out = capsys.readouterr().out
    assert rc == 3
    assert "does not fit:" in out and "MiB over" in out and "of the 2560 MiB LLM budget" in out


def test_header_alone_plans_as_the_whole_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model file cut right after its header plans exactly as the whole file does (no weight is read)."""
    config = preset_config("smollm2-135m-q4_1", fast=True, n_layers=2)
    whole = Path(write_config(tmp_path / "whole.gguf", config))
    header = Path(write_config(tmp_path / "header.gguf", config, header_only=True)).read_bytes()
    data = whole.read_bytes()
    assert data.startswith(header) and len(data) > 4 * len(header)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(header)])
    rc_whole, p_whole = plan(capsys, str(whole), "--backend", "native")
    rc_cut, p_cut = plan(capsys, str(cut), "--backend", "native")
    assert (rc_whole, rc_cut) == (0, 0)
    assert {k: v for k, v in p_cut.items() if k != "model"} == {k: v for k, v in p_whole.items() if k != "model"}


def test_unreadable_model_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file that is not a GGUF: exit 1 and the reason on stderr."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    assert main(["models", "plan", str(bad)]) == 1
    assert "not a GGUF file" in capsys.readouterr().err
