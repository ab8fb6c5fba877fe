"""The fixed part of the Home Assistant entity table: ``STATIC`` and the renderers its rows use.

Each row of ``STATIC`` is an ``Entity`` of ``docs/mqtt.md`` that every node has (the LLM, the voice
path, the platform, the policy, the switch, the buttons and the command error), in the order discovery
lists them, built by its ``Kind`` (``MIB``, ``CELSIUS``, ``RUNNING``, ...: what a family of entities
shares); ``_engine``, ``_tel``, ``_gate`` and the other helpers read one value out of the ``Inputs``
and return None where it is unknown. Entities that depend on the inputs (the policy select, the thermal limit,
one pair per watched service and per pause reason) are built in ``entities``. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .entity_model import GATE_MODES, LLM_STATES, NO_MODEL_STATES, OFF, ON, PRESS, Entity, Inputs, Kind, Render


# -- helpers the table uses -----------------------------------------------------------------
def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _engine(attr: str, digits: int | None = None) -> Render:
    """The engine's `attr` (rounded to `digits` when given), None without engine stats."""
    return lambda i: _get(i.snapshot.engine, attr, digits)


def _tel(attr: str, digits: int | None = None) -> Render:
    """The telemetry sample's `attr` (rounded to `digits` when given), None without a sample."""
    return lambda i: _get(i.snapshot.telemetry, attr, digits)


def _get(part: Any, attr: str, digits: int | None) -> Any:
    value = getattr(part, attr) if part is not None else None
    return value if digits is None else _round(value, digits)


def _telemetry(get: Callable[[Any], Any]) -> Render:
    """`get(sample)` of the telemetry sample, None without a sample."""
    return lambda i: get(i.snapshot.telemetry) if i.snapshot.telemetry is not None else None


def _gate(key: str, digits: int | None = None) -> Render:
    """The gate metric `key` (rounded to `digits` when given)."""
    return lambda i: i.gate.get(key) if digits is None else _round(i.gate.get(key), digits)


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


_in_flight = _engine("requests_in_flight")
_first_token = _engine("first_token_ms", 1)
_reaction = _gate("reaction_ms_last", 3)
_max_temp = _telemetry(lambda t: _round(max(t.temps_c.values())) if t.temps_c else None)
_temps = _telemetry(lambda t: dict(t.temps_c))
_power_mode = _telemetry(lambda t: {"power_mode": t.power_mode})


def _thermal_level(i: Inputs) -> str | None:
    return (i.snapshot.decision.thermal_level or "none") if i.snapshot.decision else None


def _backend(i: Inputs) -> dict[str, Any]:
    out = {"backend": _engine("backend")(i)}
    engine = i.snapshot.engine
    if engine is not None and engine.remote_url is not None:  # backend openai: the remote's identity and state
        out.update(remote_url=engine.remote_url, remote_model=engine.remote_model, remote_state=engine.remote_state)
    return out


def _plan_shape(i: Inputs) -> dict[str, Any]:
    return {"n_ctx": _engine("n_ctx")(i), "kv_dtype": _engine("kv_dtype")(i)}


def _policy_name(i: Inputs) -> str | None:
    return i.snapshot.policy_name


def _has_policy_error(i: Inputs) -> bool:
    return i.snapshot.policy_error is not None


def _policy_error(i: Inputs) -> dict[str, Any]:
    return {"message": i.snapshot.policy_error}


# -- the table ------------------------------------------------------------------------------
_DIAG = "diagnostic"
_MEASURE = "measurement"
_ON_OFF = {"pl_on": ON, "pl_off": OFF}

SENSOR = Kind()
ENUM = Kind(device_class="enum")
COUNT = Kind(state_class=_MEASURE)
TOTAL = Kind(state_class="total_increasing", unit="tokens")
TPS = Kind(state_class=_MEASURE, unit="tok/s", precision=1)
MS = Kind(device_class="duration", state_class=_MEASURE, unit="ms", precision=1)
SECONDS = Kind(device_class="duration", state_class=_MEASURE, unit="s", precision=2)
WATTS = Kind(device_class="power", state_class=_MEASURE, unit="W", precision=1)
DIAG = Kind(category=_DIAG)
MIB = Kind(device_class="data_size", state_class=_MEASURE, unit="MiB", icon="mdi:memory", precision=0)
CELSIUS = Kind(device_class="temperature", state_class=_MEASURE, unit="°C", precision=1)
PERCENT = Kind(state_class=_MEASURE, unit="%", precision=0)
RUNNING = Kind("binary_sensor", device_class="running", extra=_ON_OFF)
PROBLEM = Kind("binary_sensor", device_class="problem", category=_DIAG, extra=_ON_OFF)
SWITCH = Kind("switch", extra={**_ON_OFF, "stat_on": ON, "stat_off": OFF})
BUTTON = Kind("button", category="config", extra={"pl_prs": PRESS})

STATIC: tuple[Entity, ...] = (
    # the LLM
    ENUM("llm_state", "LLM state", "llm/state", _llm_state, "mdi:brain", extra={"ops": list(LLM_STATES)}),
    ENUM("gate_mode", "Decode gate", "gate/mode", _gate("mode"), "mdi:gate", extra={"ops": list(GATE_MODES)}),
    SENSOR("gate_reason", "Gate reason", "gate/reason", _gate_reason, "mdi:hand-back-left"),
    TPS("decode_tps", "Decode speed", "llm/decode_tps", _engine("decode_tps", 1), "mdi:speedometer"),
    MS("first_token_ms", "First-token latency", "llm/first_token_ms", _first_token, "mdi:timer-outline", precision=0),
    COUNT("requests_in_flight", "Requests in flight", "llm/requests_in_flight", _in_flight, "mdi:progress-clock"),
    COUNT("requests_queued", "Requests queued", "llm/requests_queued", _engine("requests_queued"), "mdi:tray-full"),
    TOTAL("tokens_total", "Tokens generated", "llm/tokens_total", _engine("tokens_total"), "mdi:counter"),
    SENSOR("model", "Model", "llm/model", _model, "mdi:file-cog", attributes=_backend),
    MIB("model_memory", "Model memory", "llm/weights_mb", _engine("weights_mb", 1), category=_DIAG),
    MIB("kv_memory", "KV cache memory", "llm/kv_mb", _engine("kv_mb", 1), category=_DIAG, attributes=_plan_shape),
    MIB("scratch_memory", "Scratch memory", "llm/scratch_mb", _engine("scratch_mb", 1), category=_DIAG),
    SECONDS(
        "start_to_ready",
        "Start to ready",
        "llm/start_to_ready_s",
        _engine("ready_s", 2),
        "mdi:timer-play-outline",
        category=_DIAG,
    ),
    MS("reaction_ms", "Pause reaction time", "gate/reaction_ms", _reaction, "mdi:timer-sand", category=_DIAG),
    # the voice path
    RUNNING("stt_active", "STT active", "voice/stt", lambda i: i.snapshot.voice.stt_active, "mdi:microphone"),
    RUNNING("tts_active", "TTS active", "voice/tts", lambda i: i.snapshot.voice.tts_active, "mdi:account-voice"),
    # the platform
    CELSIUS("gpu_temperature", "GPU temperature", "platform/gpu_temperature", _temp("gpu")),
    CELSIUS("cpu_temperature", "CPU temperature", "platform/cpu_temperature", _temp("cpu")),
    CELSIUS(
        "max_temperature", "Hottest sensor", "platform/max_temperature", _max_temp, attributes=_temps, category=_DIAG
    ),
    PERCENT("gpu_load", "GPU load", "platform/gpu_load", _tel("gpu_load_pct", 1), "mdi:expansion-card"),
    PERCENT("cpu_load", "CPU load", "platform/cpu_load", _tel("cpu_load_pct", 1), "mdi:cpu-64-bit"),
    WATTS("power", "Power", "platform/power", _telemetry(_power), attributes=_telemetry(lambda t: dict(t.power_w))),
    MIB("ram_available", "RAM available", "platform/ram_available", _tel("mem_available_mb", 0)),
    MIB("swap_used", "Swap used", "platform/swap_used", _tel("swap_used_mb", 0), "mdi:harddisk"),
    SENSOR(
        "platform", "Platform", "platform/name", _tel("platform"), "mdi:chip", attributes=_power_mode, category=_DIAG
    ),
    # the policy
    SENSOR("active_policy", "Active policy", "policy/name", _policy_name, "mdi:script-text-outline"),
    PROBLEM("policy_error", "Policy error", "policy/error", _has_policy_error, attributes=_policy_error),
    SENSOR("thermal_level", "Thermal level", "policy/thermal_level", _thermal_level, "mdi:thermometer-alert"),
    # controls
    SWITCH("llm_enabled", "LLM enabled", "llm/enabled", _llm_enabled, "mdi:robot", command="llm/enabled/set"),
    BUTTON("reload_policy", "Reload policy", command="policy/reload", icon="mdi:reload"),
    BUTTON("unload_model", "Unload model", command="llm/unload", icon="mdi:eject"),
    DIAG(
        "command_error",
        "Last command error",
        "command/last_error",
        _command_error,
        "mdi:alert-circle-outline",
        attributes=_command_error_attributes,
    ),
)
