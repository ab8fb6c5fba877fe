"""The soak benchmark end to end, tiny: ~30 operations against the real daemon, so `bench/soak.py` cannot rot.

The real daemon (subprocess) serves SmolLM2 and Gemma-3 in one swap group behind a real
Mosquitto; every kind of operation of the soak runs at least once (streams, a disconnect, voice
hints over HTTP and MQTT, an invalid and a valid policy reload, a policy select, an LLM OFF/ON
burst, a swap, an unload), then the report is written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak import LOAD_OPS, WEIGHTS, main
from bench.soak_stack import MOSQUITTO
from tests.models import GEMMA3, SMOLLM2, require


@pytest.mark.timeout(240)
@pytest.mark.skipif(MOSQUITTO is None, reason="the mosquitto binary is not installed")
def test_soak_runs_every_operation_and_writes_the_report(tmp_path: Path) -> None:
    """A short soak runs each operation kind without an unexpected failure, leaves nothing in flight,
    ends with the LLM on and the policy valid, and writes results.json, summary.md and soak.png."""
    smol, gemma = require(SMOLLM2), require(GEMMA3)
    out = tmp_path / "out"
    # One engine thread: on a busy 2-core machine two OpenMP threads can slow decode twentyfold.
    got = main(
        [
            "--requests",
            "30",
            "--warmup",
            "1",
            "--probes",
            "2",
            "--swaps",
            "1",
            "--toggles",
            "1",
            "--threads",
            "1",
            "--interval",
            "0.25",
            "--api-key",
            "soak-smoke-key",
            "--smollm2",
            str(smol),
            "--gemma3",
            str(gemma),
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "w"),
        ],
        say=lambda m: None,
    )
    data = json.loads((out / "results.json").read_text())
    a = data["analysis"]
    assert set(a["ops"]) == set(WEIGHTS) | set(LOAD_OPS)
    assert a["errors"]["unexpected"] == 0, a["errors"]["examples"]
    assert a["end"]["quiescent"] and a["end"]["llm_enabled"] is True, a["end"]["summary"]
    assert a["end"]["policy"]["error"] is None and a["end"]["policy"]["name"] in ("soak-a", "soak-b")
    counters = data["meta"]["counters"]
    assert counters["policy_rejected"] == 1 and counters["swaps"] == 1 and counters["unloads"] == 1
    assert counters["llm_toggles"] == 20
    assert a["end"]["models"]["gemma3"]["evictions"] + a["end"]["models"]["smollm2"]["evictions"] >= 1
    assert a["daemon_exit"] == 0
    assert len(data["samples"]) >= 3 and all(s["rss"] > 0 and s["fds"] > 0 for s in data["samples"])
    assert a["decode_speed_server"]["first"] and a["decode_speed_isolated"]["ratio"]
    assert got["analysis"]["goals"].keys() == {
        "rss_slope",
        "speed",
        "nothing_in_flight",
        "no_unexpected_errors",
        "graceful_exit",
    }
    summary = (out / "summary.md").read_text()
    assert "| rss_slope |" in summary and "| decode speed (tok/s, median) |" in summary
    assert (out / "soak.png").stat().st_size > 10_000
    assert (out / "daemon.log").stat().st_size > 0
