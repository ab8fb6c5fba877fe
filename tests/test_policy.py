"""Policy schema, pure evaluation, file:line errors and hot reload."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import anyio
import pytest

from genie_supervisor.errors import PolicyErrors
from genie_supervisor.events import ServiceObservation, TelemetrySample
from genie_supervisor.policy import PolicyWatcher, evaluate, load_policy, parse_policy
from genie_supervisor.policy.schema import Policy
from genie_supervisor.state import Decision, Snapshot, VoiceState
from tests import sourcefiles
from tests.sourcefiles import write_dedented

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "version": 1,
    "name": "t",
    "voice": {"stt": {"action": "pause", "resume_holdoff_ms": 300}, "tts": {"action": "throttle", "throttle_tps": 8}},
    "thermal": {
        "sensor": "tj",
        "levels": [
            {"name": "warm", "enter_c": 80, "leave_c": 75, "action": "throttle", "throttle_tps": 6},
            {"name": "hot", "enter_c": 90, "leave_c": 85, "action": "pause"},
        ],
    },
    "memory": {
        "llm_budget_mb": 2560,
        "reservations": {"whisper": 1000},
        "hysteresis_mb": 100,
        "thresholds": [
            {"below_available_mb": 1500, "action": "shrink_context", "context_tokens": 1024},
            {"below_available_mb": 1000, "action": "refuse_new"},
            {"below_available_mb": 600, "action": "unload_llm"},
        ],
    },
    "failsafe": {"stt_unknown": "pause", "telemetry_unknown": "throttle", "throttle_tps": 4, "telemetry_stale_s": 10},
}


def policy(**changes: object) -> Policy:
    """Build the test policy with top-level sections replaced."""
    return Policy.model_validate({**BASE, **changes})


def snap(
    ts: float = 100.0,
    temp: float | None = 50.0,
    mem: float | None = 5000.0,
    voice: VoiceState | None = None,
    services: dict[str, ServiceObservation] | None = None,
    tel_ts: float | None = None,
) -> Snapshot:
    """A snapshot at `ts` with one fresh telemetry sample."""
    tel = None
    if temp is not None or mem is not None:
        tel = TelemetrySample(
            "simulated",
            ts=ts if tel_ts is None else tel_ts,
            temps_c={} if temp is None else {"tj": temp},
            mem_available_mb=mem,
        )
    return Snapshot(ts=ts, started_ts=0.0, telemetry=tel, voice=voice or VoiceState(), services=services or {})


# -- evaluation: every rule ------------------------------------------------------------------


def test_quiet_box_is_open() -> None:
    """With nothing happening the gate is open and new requests are accepted."""
    d = evaluate(policy(), snap())
    assert (d.gate, d.admission, d.max_context, d.unload_llm, d.fired) == ("open", "accept", None, False, ())
    assert d.prefill_chunk_tokens == 64 and d.llm_budget_mb == 2560


def test_stt_active_pauses_with_cause_timestamp() -> None:
    """An active STT session pauses decode and names the STT start as the cause."""
    d = evaluate(policy(), snap(voice=VoiceState(stt_active=True, stt_sessions=1, stt_active_since=99.5)))
    assert d.gate == "paused" and d.pause_reasons == {"stt"}
    assert d.fired[0].rule == "voice.stt" and d.fired[0].ts == 99.5


def test_tts_active_throttles() -> None:
    """An active TTS session throttles decode to the TTS rate."""
    d = evaluate(policy(), snap(voice=VoiceState(tts_active=True, tts_sessions=1, tts_active_since=99.0)))
    assert (d.gate, d.throttle_tps, d.throttle_reasons) == ("throttled", 8, {"tts"})


def test_voice_action_none_does_nothing() -> None:
    """A voice rule with action none never fires."""
    p = policy(voice={"stt": {"action": "none"}})
    assert evaluate(p, snap(voice=VoiceState(stt_active=True, stt_sessions=1))).gate == "open"


def test_stt_resume_holdoff() -> None:
    """After STT goes idle decode stays paused until idle_since + hold-off, and says when to re-check."""
    v = VoiceState(stt_idle_since=100.0)
    held = evaluate(policy(), snap(ts=100.2, voice=v))
    assert held.gate == "paused" and held.fired[0].rule == "voice.stt.resume_holdoff_ms"
    assert held.next_eval_at == pytest.approx(100.3)
    assert evaluate(policy(), snap(ts=100.3, voice=v), held).gate == "open"


def test_thermal_levels_with_hysteresis() -> None:
    """Levels are entered at enter_c and left only at or below leave_c, stepping down through cooler levels."""
    p = policy()
    prev: Decision | None = None
    seen = []
    for temp in (70, 80, 78, 89, 90, 86, 85, 79, 75, 74):
        prev = evaluate(p, snap(temp=temp), prev)
        seen.append((temp, prev.thermal_level, prev.gate))
    assert seen == [
        (70, None, "open"),
        (80, "warm", "throttled"),
        (78, "warm", "throttled"),
        (89, "warm", "throttled"),
        (90, "hot", "paused"),
        (86, "hot", "paused"),
        (85, "warm", "throttled"),
        (79, "warm", "throttled"),
        (75, None, "open"),
        (74, None, "open"),
    ]


def test_thermal_jump_straight_to_hot_then_cool_below_warm_enter() -> None:
    """Leaving the hot level with the temperature between warm's leave and enter lands in warm."""
    p = policy()
    hot = evaluate(p, snap(temp=95))
    assert hot.thermal_level == "hot"
    assert evaluate(p, snap(temp=77), hot).thermal_level == "warm"
    assert evaluate(p, snap(temp=77)).thermal_level is None


def test_thermal_max_sensor() -> None:
    """Sensor `max` uses the hottest sensor reported."""
    p = policy(thermal={**BASE["thermal"], "sensor": "max"})  # type: ignore[dict-item]
    s = Snapshot(ts=1.0, started_ts=0.0, telemetry=TelemetrySample("simulated", ts=1.0, temps_c={"cpu": 60, "gpu": 91}))
    assert evaluate(p, s).thermal_level == "hot"


def test_memory_thresholds_accumulate_and_use_reservations() -> None:
    """Thresholds compare MemAvailable minus the unclaimed part of reservations and add up."""
    p = policy()
    # whisper up using 400 of its 1000 MiB reservation: 600 MiB held back
    svc = {"whisper": ServiceObservation("whisper", up=True, rss_mb=400)}
    d = evaluate(p, snap(mem=2000, services=svc))
    assert d.memory_active == (0,) and d.max_context == 1024 and d.admission == "accept"
    d = evaluate(p, snap(mem=1500, services=svc))
    assert d.memory_active == (0, 1) and d.admission == "refuse_new"
    d = evaluate(p, snap(mem=1100, services=svc))
    assert d.unload_llm and d.admission == "refuse_new" and d.fired[-1].inputs["effective_mb"] == 500
    assert d.gate == "open"


def test_memory_hysteresis() -> None:
    """A memory threshold keeps firing until available memory is hysteresis_mb above it."""
    p = policy(memory={**BASE["memory"], "reservations": {}})  # type: ignore[dict-item]
    d = evaluate(p, snap(mem=950))
    assert d.admission == "refuse_new"
    d = evaluate(p, snap(mem=1050), d)
    assert d.admission == "refuse_new"
    d = evaluate(p, snap(mem=1100), d)
    assert d.admission == "accept" and d.max_context == 1024


def test_pause_beats_throttle_and_lowest_throttle_wins() -> None:
    """Rules combine: any pause wins over throttles; among throttles the lowest rate wins."""
    p = policy()
    both = VoiceState(stt_active=True, stt_sessions=1, tts_active=True, tts_sessions=1)
    d = evaluate(p, snap(temp=82, voice=both))
    assert d.gate == "paused" and d.pause_reasons == {"stt"} and d.throttle_tps is None
    d = evaluate(p, snap(temp=82, voice=VoiceState(tts_active=True, tts_sessions=1)))
    assert (d.gate, d.throttle_tps, d.throttle_reasons) == ("throttled", 6, {"tts", "thermal"})
    d = evaluate(p, snap(temp=95, mem=500, voice=both))
    assert d.pause_reasons == {"stt", "thermal"} and d.unload_llm and d.admission == "refuse_new"


def test_failsafe_stt_unknown() -> None:
    """A watched STT service in an unknown state triggers the stt_unknown failsafe."""
    d = evaluate(policy(), snap(voice=VoiceState(stt_unknown=True)))
    assert d.pause_reasons == {"stt_unknown"}
    p = policy(failsafe={**BASE["failsafe"], "stt_unknown": "ignore"})  # type: ignore[dict-item]
    assert evaluate(p, snap(voice=VoiceState(stt_unknown=True))).gate == "open"


def test_failsafe_stale_or_missing_telemetry() -> None:
    """Stale telemetry, a missing sensor, or no sample after the grace time throttle decode."""
    p = policy()
    fresh = evaluate(p, snap(ts=105, tel_ts=100))
    assert fresh.gate == "open" and fresh.next_eval_at == pytest.approx(110, abs=1e-3)
    stale = evaluate(p, snap(ts=111, tel_ts=100, temp=95))
    assert stale.gate == "throttled" and stale.throttle_tps == 4 and stale.thermal_level is None
    assert stale.fired[-1].inputs == {"telemetry_age_s": 11.0}
    missing = evaluate(p, snap(temp=None))
    assert missing.fired[-1].inputs == {"sensor_missing": "tj"}
    early = Snapshot(ts=5.0, started_ts=0.0)
    assert evaluate(p, early).gate == "open" and evaluate(p, early).next_eval_at == pytest.approx(10, abs=1e-3)
    assert evaluate(p, Snapshot(ts=11.0, started_ts=0.0)).fired[-1].inputs == {"telemetry": "missing"}


def test_failsafe_not_needed_without_telemetry_rules() -> None:
    """Without thermal levels or memory thresholds, missing telemetry is no reason to act."""
    p = policy(thermal={"levels": []}, memory={"thresholds": []})
    assert evaluate(p, Snapshot(ts=100.0, started_ts=0.0)).gate == "open"


def test_evaluate_is_pure() -> None:
    """The same inputs give equal decisions."""
    p, s = policy(), snap(temp=82)
    assert evaluate(p, s) == evaluate(p, s)


def test_hysteresis_state_ignored_across_policies() -> None:
    """A previous decision from another policy carries no hysteresis state."""
    prev = evaluate(policy(), snap(temp=95))
    other = policy(name="other")
    assert evaluate(other, snap(temp=87), prev).thermal_level == "warm"


# -- files: errors with file:line ------------------------------------------------------------


def write(tmp_path: Path, text: str) -> str:
    """Write a dedented policy file and return its path."""
    return write_dedented(tmp_path / "p.yaml", text)


def errors_of(path: str) -> list[str]:
    """The formatted errors of loading `path`."""
    return sourcefiles.errors_of(load_policy, PolicyErrors, path)


@pytest.mark.parametrize("name", ["default.yaml", "orin-nano-8gb.yaml"])
def test_shipped_policies_load(name: str) -> None:
    """The shipped policies are valid."""
    assert load_policy(ROOT / "policies" / name).version == 1


def test_malformed_yaml(tmp_path: Path) -> None:
    """Malformed YAML is reported at the parser's line."""
    f = write(
        tmp_path,
        """
        version: 1
        name: x
        voice:
          stt: {action: pause
        thermal: {}
        """,
    )
    (err,) = errors_of(f)
    assert err.startswith(f"{f}:5: malformed YAML:")


class BadFile(NamedTuple):
    """One invalid policy file and the errors it must produce."""

    behaviour: str
    """What the case shows, in one sentence."""
    text: str
    """The file's text (dedented before writing)."""
    errors: list[str]
    """The expected errors, each after the file's path."""


BAD_FILES = {
    "unknown-key": BadFile(
        "An unknown key is named with its line and the keys that were expected.",
        """
        version: 1
        name: x
        voice:
          stt:
            action: pause
            resume_holdof_ms: 100
        """,
        [
            ":6 voice.stt.resume_holdof_ms: unknown key (did you mean 'resume_holdoff_ms'?); "
            "expected one of: action, resume_holdoff_ms, throttle_tps"
        ],
    ),
    "wrong-type": BadFile(
        "A wrong type names the value that was given.",
        """
        version: 1
        name: x
        thermal:
          levels:
            - {name: warm, enter_c: hot, leave_c: 70, action: pause}
        """,
        [
            ":5 thermal.levels[0].enter_c: Input should be a valid number, unable to parse string as a number "
            "(got 'hot')"
        ],
    ),
    "bad-enum-value": BadFile(
        "A value outside a choice lists the allowed ones.",
        """
        version: 1
        name: x
        voice:
          stt: {action: stop}
        """,
        [":4 voice.stt.action: Input should be 'pause', 'throttle' or 'none' (got 'stop')"],
    ),
    "out-of-range": BadFile(
        "An out-of-range number names the bound and the value.",
        """
        version: 1
        name: x
        voice:
          prefill_chunk_tokens: 0
        """,
        [":4 voice.prefill_chunk_tokens: Input should be greater than or equal to 1 (got 0)"],
    ),
    "missing-and-wrong-version": BadFile(
        "A missing required key points at its parent, a wrong version names the version.",
        """
        version: 2
        description: no name
        """,
        [":1 name: required key is missing", ":1 version: Input should be 1 (got 2)"],
    ),
    "contradictory-thermal-thresholds": BadFile(
        "leave_c at or above enter_c is rejected at the leave_c line with one sentence.",
        """
        version: 1
        name: x
        thermal:
          levels:
            - name: warm
              enter_c: 80
              leave_c: 82
              action: pause
        """,
        [":7 thermal.levels[0].leave_c: leave_c (82) must be below enter_c (80) for hysteresis"],
    ),
    "thermal-levels-out-of-order": BadFile(
        "A hotter level listed before a cooler one is rejected at its enter_c.",
        """
        version: 1
        name: x
        thermal:
          levels:
            - {name: hot, enter_c: 90, leave_c: 85, action: pause}
            - name: warm
              enter_c: 80
              leave_c: 75
              action: pause
        """,
        [
            ":7 thermal.levels[1].enter_c: enter_c (80) must be above the previous level's enter_c (90); "
            "list levels from coolest to hottest"
        ],
    ),
    "hotter-level-cannot-be-milder": BadFile(
        "A hotter level that throttles less than a cooler one is contradictory.",
        """
        version: 1
        name: x
        thermal:
          levels:
            - {name: warm, enter_c: 80, leave_c: 75, action: throttle, throttle_tps: 5}
            - {name: hot, enter_c: 90, leave_c: 85, action: throttle, throttle_tps: 10}
        """,
        [":6 thermal.levels[1].throttle_tps: throttle_tps (10) must not rise above the cooler level's (5)"],
    ),
    "memory-thresholds-out-of-order-and-throttle-without-rate": BadFile(
        "Every problem of a file is reported, each at its own line.",
        """
        version: 1
        name: x
        voice:
          tts: {action: throttle}
        memory:
          thresholds:
            - {below_available_mb: 500, action: refuse_new}
            - below_available_mb: 900
              action: unload_llm
        """,
        [
            ":4 voice.tts.throttle_tps: action throttle needs throttle_tps (tokens/s)",
            ":8 memory.thresholds[1].below_available_mb: below_available_mb (900) must be lower than the "
            "previous threshold's (500); list thresholds from mildest to most severe",
        ],
    ),
    "duplicate-key": BadFile(
        "A key given twice is an error instead of silently taking the last one.",
        """
        version: 1
        name: x
        name: y
        """,
        [":3 name: duplicate key (first at line 2)"],
    ),
    "top-level-not-a-mapping": BadFile(
        "A file that is a list, not a mapping, is rejected.",
        "- 1\n- 2\n",
        [":1: expected a mapping of keys at the top level, got list"],
    ),
}


@pytest.mark.parametrize("case", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_file_errors(tmp_path: Path, case: BadFile) -> None:
    """Each invalid file is reported as file:line key.path: message, as its case's behaviour says."""
    f = write(tmp_path, case.text)
    assert errors_of(f) == [f + e for e in case.errors]


def test_parse_policy_names_the_source() -> None:
    """parse_policy uses the given name in its errors."""
    with pytest.raises(PolicyErrors, match=r"^inline:1 version: required key is missing"):
        parse_policy("name: x\n", "inline")


# -- hot reload ------------------------------------------------------------------------------

GOOD = "version: 1\nname: {name}\n"


def replace_file(path: Path, text: str) -> None:
    """Replace a file atomically, as editors do, so the watcher never reads half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_hot_reload_keeps_old_policy_on_bad_file(tmp_path: Path) -> None:
    """A changed file is picked up; a broken one is rejected with its error and the old policy stays."""
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.format(name="one"))
    watcher = PolicyWatcher(path, poll_interval_s=0.01)
    seen: list[tuple[str, bool]] = []
    changed = anyio.Event()
    box = {"event": changed}

    def listener(p: Policy, err: PolicyErrors | None) -> None:
        seen.append((p.name, err is not None))
        box["event"].set()

    watcher.add_listener(listener)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            assert watcher.policy is not None and watcher.policy.name == "one"

            box["event"] = anyio.Event()
            replace_file(path, GOOD.format(name="two-longer"))
            await box["event"].wait()
            assert watcher.policy.name == "two-longer" and watcher.last_error is None

            box["event"] = anyio.Event()
            replace_file(path, "version: 1\nname: a: b\n")
            await box["event"].wait()
            assert watcher.policy.name == "two-longer"
            assert watcher.last_error is not None
            assert str(watcher.last_error).startswith(f"{path}:2: malformed YAML: mapping values")
            tg.cancel_scope.cancel()
    assert seen == [("one", False), ("two-longer", False), ("two-longer", True)]


async def test_explicit_reload(tmp_path: Path) -> None:
    """reload() (SIGHUP) loads the file now and reports whether the new policy is in force."""
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.format(name="one"))
    watcher = PolicyWatcher(path)
    await watcher.load()
    path.write_text(GOOD.format(name="two"))
    assert await watcher.reload() is True and watcher.policy is not None and watcher.policy.name == "two"
    path.write_text("version: 3\nname: three\n")
    assert await watcher.reload() is False and watcher.policy.name == "two"
    assert watcher.generation == 2


async def test_first_load_of_bad_file_raises(tmp_path: Path) -> None:
    """The daemon must not start on an invalid policy: the first load raises."""
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\n")
    with pytest.raises(PolicyErrors):
        await PolicyWatcher(os.fspath(path)).load()
