"""`genie-supervisor policy check` and `policy simulate` through the real command line entry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from genie_supervisor.cli import main

ROOT = Path(__file__).resolve().parents[1]
ORIN = str(ROOT / "policies/orin-nano-8gb.yaml")


def test_check_ok(capsys: pytest.CaptureFixture[str]) -> None:
    """Valid files print one ok line each and exit 0."""
    assert main(["policy", "check", ORIN, str(ROOT / "policies/default.yaml")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{ORIN}: ok (policy 'orin-nano-8gb', version 1)",
        f"{ROOT / 'policies/default.yaml'}: ok (policy 'default', version 1)",
    ]


def test_check_errors_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad file prints file:line key.path: message lines and exits 1, good files still say ok."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nname: x\nthermal:\n  sensr: tj\n")
    assert main(["policy", "check", str(bad), ORIN]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{bad}:4 thermal.sensr: unknown key (did you mean 'sensor'?); expected one of: levels, sensor"
    assert out[1].endswith("ok (policy 'orin-nano-8gb', version 1)")


def trace(tmp_path: Path, records: list[dict[str, object]]) -> str:
    """Write a JSONL trace and return its path."""
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(p)


def test_simulate_prints_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Simulate prints every decision change: STT pause, hold-off end, thermal throttle and its hysteresis."""
    t = trace(
        tmp_path,
        [
            {"t": 0.0, "type": "telemetry", "platform": "simulated", "temps_c": {"tj": 60}, "mem_available_mb": 5000},
            {"t": 1.0, "type": "voice", "service": "stt", "active": True, "session": "a"},
            {"t": 2.0, "type": "voice", "service": "stt", "active": False, "session": "a"},
            {"t": 3.0, "type": "telemetry", "platform": "simulated", "temps_c": {"tj": 81}, "mem_available_mb": 5000},
            {"t": 4.0, "type": "telemetry", "platform": "simulated", "temps_c": {"tj": 77}, "mem_available_mb": 5000},
            {"t": 5.0, "type": "telemetry", "platform": "simulated", "temps_c": {"tj": 74}, "mem_available_mb": 5000},
            {"t": 6.0, "type": "tick"},
        ],
    )
    assert main(["policy", "simulate", ORIN, "--trace", t]) == 0
    out = capsys.readouterr().out
    lines = [re.sub(r"\s+", " ", x.strip()) for x in out.splitlines()]
    assert lines[0] == f"policy 'orin-nano-8gb' ({ORIN}) over {t}: 7 events"
    assert lines[1].startswith("0.000s open <- no rule")
    assert lines[2].startswith('1.000s paused(stt) voice=open <- voice.stt {"sessions": 1}')
    assert lines[3].startswith("2.150s open")
    assert lines[4].startswith("3.000s throttled(6tps:thermal) thermal=warm <- thermal.levels[warm]")
    assert lines[5].startswith("5.000s open")
    assert lines[6] == "time per gate mode: open 2.850s, paused 1.150s, throttled 2.000s"


def test_simulate_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plot writes a PNG of the timeline."""
    pytest.importorskip("matplotlib")
    t = trace(
        tmp_path,
        [
            {"t": 0.0, "type": "telemetry", "platform": "simulated", "temps_c": {"tj": 95}, "mem_available_mb": 900},
            {"t": 1.0, "type": "telemetry", "platform": "simulated", "temps_c": {"tj": 60}, "mem_available_mb": 5000},
        ],
    )
    png = tmp_path / "out.png"
    assert main(["policy", "simulate", ORIN, "--trace", t, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad trace line is reported with its file and line and exits 1."""
    t = trace(tmp_path, [{"t": 0, "type": "voice", "service": "stt", "active": True, "colour": "red"}])
    assert main(["policy", "simulate", ORIN, "--trace", t]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"error: {t}:1: unknown field 'colour' for VoiceActivity")


def test_simulate_bad_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Simulating an invalid policy prints its errors and exits 1."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\n")
    t = trace(tmp_path, [{"t": 0, "type": "tick"}])
    assert main(["policy", "simulate", str(bad), "--trace", t]) == 1
    assert capsys.readouterr().out.strip() == f"{bad}:1 name: required key is missing"


def doc_examples() -> list[str]:
    """The complete policies shown in docs/policy.md (yaml blocks that start with `version:`)."""
    text = (ROOT / "docs/policy.md").read_text()
    return [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith("version:")]


def test_doc_examples_pass_policy_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every example policy in docs/policy.md passes `policy check`."""
    examples = doc_examples()
    assert len(examples) >= 6
    files = []
    for i, block in enumerate(examples):
        f = tmp_path / f"example{i}.yaml"
        f.write_text(block)
        files.append(str(f))
    assert main(["policy", "check", *files]) == 0, capsys.readouterr().out
