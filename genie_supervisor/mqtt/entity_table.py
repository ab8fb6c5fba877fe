"""The fixed part of the Home Assistant entity table: ``STATIC`` and the renderers its rows use.

Each row of ``STATIC`` is an ``Entity`` of ``docs/mqtt.md`` that every node has (the LLM, the voice
path, the platform, the policy, the switch, the buttons and the command error), in the order discovery lists them;
``_engine``, ``_telemetry`` and the other helpers read one value out of the ``Inputs`` and return
None where it is unknown. Entities that depend on the inputs (the policy select, the thermal limit,
one pair per watched service and per pause reason) are built in ``entities``. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .entity_model import GATE_MODES, LLM_STATES, NO_MODEL_STATES, OFF, ON, PRESS, Entity, Inputs, Render


# -- helpers the table uses -----------------------------------------------------------------
def _engine(attr: str) -> Render:
    return lambda i: getattr(i.snapshot.engine, attr) if i.snapshot.engine is not None else None


def _telemetry(get: Callable[[Any], Any]) -> Render:
    return lambda i: get(i.snapshot.telemetry) if i.snapshot.telemetry is not None else None


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _llm_state(i: Inputs) -> str | None:
    if i.llm_enabled is False:
        return "disabled"
    engine = i.snapshot.engine
    return engine.state if engine is not None and engine.state in LLM_STATES else None


def _model(i: Inputs) -> str:
    engine = i.snapshot.engine
    if engine is None or engine.state in NO_MODEL_STATES:
        return "none"
    return engine.model or "none"


def _command_error(i: Inputs) -> str:
    e = i.command_error
    return "none" if e is None else e.reason[:255]  # Home Assistant keeps at most 255 characters


def _command_error_attributes(i: Inputs) -> dict[str, Any]:
    e = i.command_error
    return {} if e is None else {"topic": e.topic, "payload": e.payload, "reason": e.reason, "time": e.time}


def _llm_enabled(i: Inputs) -> bool:
    if i.llm_enabled is not None:
        return i.llm_enabled
    return i.snapshot.engine is None or i.snapshot.engine.state != "disabled"


def _gate_reason(i: Inputs) -> str:
    reasons = list(i.gate.get("reasons") or ())
    if not reasons and i.gate.get("mode") == "throttled" and i.snapshot.decision is not None:
        reasons = sorted(i.snapshot.decision.throttle_reasons)
    return ",".join(reasons) if reasons else "none"


def _power(t: Any) -> float | None:
    rails: dict[str, float] = t.power_w
    if not rails:
        return None
    return _round(rails.get("VDD_IN", sum(rails.values())), 2)


def _temp(sensor: str) -> Render:
    return _telemetry(lambda t: _round(t.temps_c.get(sensor)))


# -- the table ------------------------------------------------------------------------------
_DIAG = "diagnostic"
_MEASURE = "measurement"

STATIC: tuple[Entity, ...] = (
    # the LLM
    Entity(
        "llm_state",
        "sensor",
        "LLM state",
        "llm/state",
        _llm_state,
        device_class="enum",
        icon="mdi:brain",
        extra={"ops": list(LLM_STATES)},
    ),
    Entity(
        "gate_mode",
        "sensor",
        "Decode gate",
        "gate/mode",
        lambda i: i.gate.get("mode"),
        device_class="enum",
        icon="mdi:gate",
        extra={"ops": list(GATE_MODES)},
    ),
    Entity("gate_reason", "sensor", "Gate reason", "gate/reason", _gate_reason, icon="mdi:hand-back-left"),
    Entity(
        "decode_tps",
        "sensor",
        "Decode speed",
        "llm/decode_tps",
        lambda i: _round(_engine("decode_tps")(i)),
        state_class=_MEASURE,
        unit="tok/s",
        icon="mdi:speedometer",
        precision=1,
    ),
    Entity(
        "first_token_ms",
        "sensor",
        "First-token latency",
        "llm/first_token_ms",
        lambda i: _round(_engine("first_token_ms")(i)),
        device_class="duration",
        state_class=_MEASURE,
        unit="ms",
        icon="mdi:timer-outline",
        precision=0,
    ),
    Entity(
        "requests_in_flight",
        "sensor",
        "Requests in flight",
        "llm/requests_in_flight",
        _engine("requests_in_flight"),
        state_class=_MEASURE,
        icon="mdi:progress-clock",
    ),
    Entity(
        "requests_queued",
        "sensor",
        "Requests queued",
        "llm/requests_queued",
        _engine("requests_queued"),
        state_class=_MEASURE,
        icon="mdi:tray-full",
    ),
    Entity(
        "tokens_total",
        "sensor",
        "Tokens generated",
        "llm/tokens_total",
        _engine("tokens_total"),
        state_class="total_increasing",
        unit="tokens",
        icon="mdi:counter",
    ),
    Entity(
        "model",
        "sensor",
        "Model",
        "llm/model",
        _model,
        attributes=lambda i: {"backend": _engine("backend")(i)},
        icon="mdi:file-cog",
    ),
    Entity(
        "model_memory",
        "sensor",
        "Model memory",
        "llm/weights_mb",
        lambda i: _round(_engine("weights_mb")(i)),
        device_class="data_size",
        state_class=_MEASURE,
        unit="MiB",
        icon="mdi:memory",
        category=_DIAG,
        precision=0,
    ),
    Entity(
        "kv_memory",
        "sensor",
        "KV cache memory",
        "llm/kv_mb",
        lambda i: _round(_engine("kv_mb")(i)),
        device_class="data_size",
        state_class=_MEASURE,
        unit="MiB",
        icon="mdi:memory",
        category=_DIAG,
        precision=0,
    ),
    Entity(
        "reaction_ms",
        "sensor",
        "Pause reaction time",
        "gate/reaction_ms",
        lambda i: _round(i.gate.get("reaction_ms_last"), 3),
        device_class="duration",
        state_class=_MEASURE,
        unit="ms",
        icon="mdi:timer-sand",
        category=_DIAG,
        precision=1,
    ),
    # the voice path
    Entity(
        "stt_active",
        "binary_sensor",
        "STT active",
        "voice/stt",
        lambda i: i.snapshot.voice.stt_active,
        device_class="running",
        icon="mdi:microphone",
        extra={"pl_on": ON, "pl_off": OFF},
    ),
    Entity(
        "tts_active",
        "binary_sensor",
        "TTS active",
        "voice/tts",
        lambda i: i.snapshot.voice.tts_active,
        device_class="running",
        icon="mdi:account-voice",
        extra={"pl_on": ON, "pl_off": OFF},
    ),
    # the platform
    Entity(
        "gpu_temperature",
        "sensor",
        "GPU temperature",
        "platform/gpu_temperature",
        _temp("gpu"),
        device_class="temperature",
        state_class=_MEASURE,
        unit="°C",
        precision=1,
    ),
    Entity(
        "cpu_temperature",
        "sensor",
        "CPU temperature",
        "platform/cpu_temperature",
        _temp("cpu"),
        device_class="temperature",
        state_class=_MEASURE,
        unit="°C",
        precision=1,
    ),
    Entity(
        "max_temperature",
        "sensor",
        "Hottest sensor",
        "platform/max_temperature",
        _telemetry(lambda t: _round(max(t.temps_c.values())) if t.temps_c else None),
        attributes=_telemetry(lambda t: dict(t.temps_c)),
        device_class="temperature",
        state_class=_MEASURE,
        unit="°C",
        precision=1,
        category=_DIAG,
    ),
    Entity(
        "gpu_load",
        "sensor",
        "GPU load",
        "platform/gpu_load",
        _telemetry(lambda t: _round(t.gpu_load_pct)),
        state_class=_MEASURE,
        unit="%",
        icon="mdi:expansion-card",
        precision=0,
    ),
    Entity(
        "cpu_load",
        "sensor",
        "CPU load",
        "platform/cpu_load",
        _telemetry(lambda t: _round(t.cpu_load_pct)),
        state_class=_MEASURE,
        unit="%",
        icon="mdi:cpu-64-bit",
        precision=0,
    ),
    Entity(
        "power",
        "sensor",
        "Power",
        "platform/power",
        _telemetry(_power),
        attributes=_telemetry(lambda t: dict(t.power_w)),
        device_class="power",
        state_class=_MEASURE,
        unit="W",
        precision=1,
    ),
    Entity(
        "ram_available",
        "sensor",
        "RAM available",
        "platform/ram_available",
        _telemetry(lambda t: _round(t.mem_available_mb, 0)),
        device_class="data_size",
        state_class=_MEASURE,
        unit="MiB",
        icon="mdi:memory",
        precision=0,
    ),
    Entity(
        "swap_used",
        "sensor",
        "Swap used",
        "platform/swap_used",
        _telemetry(lambda t: _round(t.swap_used_mb, 0)),
        device_class="data_size",
        state_class=_MEASURE,
        unit="MiB",
        icon="mdi:harddisk",
        precision=0,
    ),
    Entity(
        "platform",
        "sensor",
        "Platform",
        "platform/name",
        _telemetry(lambda t: t.platform),
        attributes=_telemetry(lambda t: {"power_mode": t.power_mode}),
        icon="mdi:chip",
        category=_DIAG,
    ),
    # the policy
    Entity(
        "active_policy",
        "sensor",
        "Active policy",
        "policy/name",
        lambda i: i.snapshot.policy_name,
        icon="mdi:script-text-outline",
    ),
    Entity(
        "policy_error",
        "binary_sensor",
        "Policy error",
        "policy/error",
        lambda i: i.snapshot.policy_error is not None,
        attributes=lambda i: {"message": i.snapshot.policy_error},
        device_class="problem",
        category=_DIAG,
        extra={"pl_on": ON, "pl_off": OFF},
    ),
    Entity(
        "thermal_level",
        "sensor",
        "Thermal level",
        "policy/thermal_level",
        lambda i: (i.snapshot.decision.thermal_level or "none") if i.snapshot.decision else None,
        icon="mdi:thermometer-alert",
    ),
    # controls
    Entity(
        "llm_enabled",
        "switch",
        "LLM enabled",
        "llm/enabled",
        _llm_enabled,
        command="llm/enabled/set",
        icon="mdi:robot",
        extra={"pl_on": ON, "pl_off": OFF, "stat_on": ON, "stat_off": OFF},
    ),
    Entity(
        "reload_policy",
        "button",
        "Reload policy",
        command="policy/reload",
        icon="mdi:reload",
        category="config",
        extra={"pl_prs": PRESS},
    ),
    Entity(
        "unload_model",
        "button",
        "Unload model",
        command="llm/unload",
        icon="mdi:eject",
        category="config",
        extra={"pl_prs": PRESS},
    ),
    Entity(
        "command_error",
        "sensor",
        "Last command error",
        "command/last_error",
        _command_error,
        attributes=_command_error_attributes,
        icon="mdi:alert-circle-outline",
        category=_DIAG,
    ),
)
