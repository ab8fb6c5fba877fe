"""bench.decode_ab: two checkouts' engines prefill and decode the same model in alternating fresh processes,
and the report gives each figure's ratio and whether the logits agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import decode_ab
from tests.models import SMOLLM2, require

pytestmark = pytest.mark.timeout(300)


def test_summary_gives_medians_ratios_and_flags_differing_logits() -> None:
    """Medians per checkout, this / reference, and logits_identical False as soon as one hash differs."""
    s = [
        {"model": "a", "side": "this", "logits_sha": "x", "generate_tok_s": 110.0, "gpu_replay_tok_s": 120.0},
        {"model": "a", "side": "this", "logits_sha": "x", "generate_tok_s": 130.0, "gpu_replay_tok_s": 120.0},
        {"model": "a", "side": "reference", "logits_sha": "x", "generate_tok_s": 100.0, "gpu_replay_tok_s": 100.0},
        {"model": "b", "side": "this", "logits_sha": "y", "generate_tok_s": 50.0},
        {"model": "b", "side": "reference", "logits_sha": "z", "generate_tok_s": 100.0},
    ]
    rows = decode_ab.summarise(s)
    assert rows[0] == {
        "model": "a",
        "logits_identical": True,
        "generate_tok_s": {"this": 120.0, "reference": 100.0, "ratio": 1.2},
        "gpu_replay_tok_s": {"this": 120.0, "reference": 100.0, "ratio": 1.2},
    }
    assert rows[1]["logits_identical"] is False and "gpu_replay_tok_s" not in rows[1]
    assert rows[1]["generate_tok_s"]["ratio"] == 0.5
    assert any("DIFFER" in line for line in decode_ab.report(rows))


def test_a_checkout_against_itself_decodes_the_same_logits(tmp_path: Path) -> None:
    """The real SmolLM2 on the native kernels, this checkout against itself with two threads
    (`--env`, this side's processes only): both sides sampled, identical logits, a result file written."""
    model = require(SMOLLM2)
    argv = ["--against", str(decode_ab.ROOT), "--model", str(model), "--backend", "native", "--prompt", "24"]
    argv += ["--tokens", "6", "--steps", "3", "--gen-runs", "1", "--rounds", "1", "--out", str(tmp_path)]
    argv += ["--env", "GENIE_THREADS=2"]
    assert decode_ab.main(argv) == 0
    (out,) = tmp_path.glob("decode_ab-*.md")
    text = out.read_text()
    assert '"side": "this"' in text and '"side": "reference"' in text
    assert "| identical |" in text and "DIFFER" not in text
    assert "| prefill_tok_s |" in text and "| generate_tok_s |" in text
    samples = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    assert [s["env"].get("GENIE_THREADS") for s in samples] == ["2", None], samples
