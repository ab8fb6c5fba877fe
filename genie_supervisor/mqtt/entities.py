"""The Home Assistant entities: what each one is, where its state lives, and how it is computed.

An ``Entity`` is a row of the table in ``docs/mqtt.md``. ``entities(inputs)`` lists the entities
for the current inputs (watched services and pause reasons come and go with the snapshot), and
``Entity.render(inputs)`` gives each one's state payload. Nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..state import Snapshot

LLM_STATES = ("idle", "loading", "prefill", "decoding", "paused", "throttled", "error", "disabled", "unloaded")
"""Values of the LLM state sensor (every state the engine host and the model manager report)."""
NO_MODEL_STATES = ("unloaded", "disabled")
"""LLM states in which the model sensor reads ``none``."""
GATE_MODES = ("open", "throttled", "paused")
"""Values of the decode gate sensor."""
KNOWN_PAUSE_REASONS = ("stt", "tts", "thermal", "memory")
"""Pause reasons that always have counters; others appear once the gate has seen them."""
NONE = "None"
"""The payload Home Assistant reads as "unknown" for sensors and binary sensors."""
ON, OFF = "ON", "OFF"
PRESS = "PRESS"


@dataclass(frozen=True)
class Topics:
    """Every topic of one node."""

    base: str
    """``<base_topic>/<node_id>``: state and command topics live under it."""
    discovery_prefix: str
    """Home Assistant discovery prefix."""
    node_id: str
    """This box's id."""

    @classmethod
    def make(cls, base_topic: str, discovery_prefix: str, node_id: str) -> Topics:
        """Topics for `node_id` under `base_topic` and `discovery_prefix`."""
        return cls(f"{base_topic}/{node_id}", discovery_prefix, node_id)

    def state(self, path: str) -> str:
        """A topic under the node's base."""
        return f"{self.base}/{path}"

    @property
    def availability(self) -> str:
        """Retained ``online`` / ``offline``; the will message goes here."""
        return self.state("availability")

    @property
    def voice_events(self) -> str:
        """Voice hints in (same JSON as ``POST /v1/voice/events``)."""
        return self.state("voice/events")

    @property
    def device_config(self) -> str:
        """The one device-based discovery message."""
        return f"{self.discovery_prefix}/device/{self.node_id}/config"

    def entity_config(self, platform: str, key: str) -> str:
        """A per-entity discovery message (older Home Assistant)."""
        return f"{self.discovery_prefix}/{platform}/{self.node_id}/{key}/config"

    @property
    def entity_config_filter(self) -> str:
        """Subscription matching every per-entity discovery message of this node."""
        return f"{self.discovery_prefix}/+/{self.node_id}/+/config"

    @property
    def ha_status(self) -> str:
        """Home Assistant's birth / will topic."""
        return f"{self.discovery_prefix}/status"


@dataclass(frozen=True)
class CommandRefusal:
    """A command that was refused: what Home Assistant's ``command_error`` sensor shows."""

    topic: str
    """Command topic it arrived on."""
    payload: str
    """What arrived, as text (cut short)."""
    reason: str
    """Why it was refused."""
    time: str
    """When, ISO 8601 in UTC."""


@dataclass(frozen=True)
class Inputs:
    """What the entities are computed from at one moment."""

    snapshot: Snapshot
    """The store's snapshot."""
    gate: Mapping[str, Any] = field(default_factory=dict)
    """``DecodeGate.metrics()``."""
    policy_options: Sequence[str] = ()
    """Choices of the policy select."""
    active_policy: str | None = None
    """The selected policy option (falls back to the snapshot's policy name)."""
    llm_enabled: bool | None = None
    """Whether the LLM is enabled (falls back to the engine state not being ``disabled``)."""
    thermal_soft_limit: float | None = None
    """The thermal soft limit in °C, None where unknown."""
    thermal_limit_range: tuple[float, float] = (40.0, 105.0)
    """Bounds of the thermal soft limit number."""
    command_error: CommandRefusal | None = None
    """The last refused command, None since start if none was refused."""


Render = Callable[[Inputs], Any]


@dataclass(frozen=True)
class Entity:
    """One Home Assistant entity of the device."""

    key: str
    """Component id, object id and unique-id suffix, e.g. ``llm_state``."""
    platform: str
    """``sensor``, ``binary_sensor``, ``select``, ``switch``, ``button`` or ``number``."""
    name: str
    """Entity name, shown after the device name."""
    state: str | None = None
    """State topic path under the node's base (None for buttons)."""
    value: Render | None = None
    """Computes the state; None becomes ``None`` (unknown), bools ``ON``/``OFF``."""
    command: str | None = None
    """Command topic path under the node's base (controls only)."""
    attributes: Render | None = None
    """Computes a JSON attributes mapping, published on ``<state>/attributes``."""
    device_class: str | None = None
    state_class: str | None = None
    unit: str | None = None
    icon: str | None = None
    category: str | None = None
    """``diagnostic`` for internals, ``config`` for settings, None for primary entities."""
    precision: int | None = None
    """Suggested display precision."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further discovery options (abbreviated), e.g. ``ops``, ``min``, ``max``."""
    on_change: bool = True
    """Publish as soon as the value changes; False waits for the periodic refresh (ever-growing timers)."""

    @property
    def attributes_topic(self) -> str | None:
        """Path of the JSON attributes topic, None without attributes."""
        return f"{self.state}/attributes" if self.attributes is not None and self.state else None

    def render(self, inputs: Inputs) -> str | None:
        """The state payload now (None for entities without state)."""
        if self.value is None:
            return None
        return payload(self.value(inputs))

    def render_attributes(self, inputs: Inputs) -> str | None:
        """The attributes payload now (None without attributes)."""
        if self.attributes is None:
            return None
        return json.dumps(self.attributes(inputs), sort_keys=True, default=str)


def payload(value: Any) -> str:
    """A state value as Home Assistant reads it."""
    if value is None:
        return NONE
    if isinstance(value, bool):
        return ON if value else OFF
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if value == value else NONE
    return str(value)


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


def _selected_policy(i: Inputs) -> str | None:
    return i.active_policy if i.active_policy is not None else i.snapshot.policy_name


def pause_reasons(gate: Mapping[str, Any]) -> list[str]:
    """Reasons that get pause counters: the known ones plus any the gate has seen."""
    seen = set(gate.get("pauses_total") or {}) | set(gate.get("paused_seconds") or {})
    return [*KNOWN_PAUSE_REASONS, *sorted(seen - set(KNOWN_PAUSE_REASONS))]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name.lower())


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


def policy_choices(inputs: Inputs) -> list[str]:
    """Options of the policy select: never empty (Home Assistant refuses a select without options)."""
    options = list(dict.fromkeys(inputs.policy_options))
    current = _selected_policy(inputs)
    if not options:
        options = [current or "default"]
    return options


def _controls(inputs: Inputs) -> list[Entity]:
    low, high = inputs.thermal_limit_range
    return [
        Entity(
            "policy_select",
            "select",
            "Policy file",
            "policy/selected",
            _selected_policy,
            command="policy/set",
            icon="mdi:script-text",
            category="config",
            extra={"ops": policy_choices(inputs)},
        ),
        Entity(
            "thermal_soft_limit",
            "number",
            "Thermal soft limit",
            "thermal/soft_limit",
            lambda i: i.thermal_soft_limit,
            command="thermal/soft_limit/set",
            device_class="temperature",
            unit="°C",
            icon="mdi:thermometer-chevron-up",
            category="config",
            extra={"min": low, "max": high, "step": 0.5, "mode": "box"},
        ),
    ]


def _service_entities(name: str) -> list[Entity]:
    key = _slug(name)

    def obs(i: Inputs) -> Any:
        return i.snapshot.services.get(name)

    return [
        Entity(
            f"service_{key}_up",
            "binary_sensor",
            f"{name} connected",
            f"service/{key}/up",
            lambda i: o.up if (o := obs(i)) is not None else None,
            attributes=lambda i: (
                {"reason": o.reason, "restarts": o.restarts, "pids": list(o.pids)} if (o := obs(i)) is not None else {}
            ),
            device_class="connectivity",
            extra={"pl_on": ON, "pl_off": OFF},
        ),
        Entity(
            f"service_{key}_memory",
            "sensor",
            f"{name} memory",
            f"service/{key}/memory",
            lambda i: _round(o.rss_mb, 0) if (o := obs(i)) is not None else None,
            device_class="data_size",
            state_class=_MEASURE,
            unit="MiB",
            icon="mdi:memory",
            precision=0,
        ),
    ]


def _pause_entities(reason: str) -> list[Entity]:
    key = _slug(reason)
    return [
        Entity(
            f"pauses_{key}",
            "sensor",
            f"Pauses ({reason})",
            f"gate/pauses/{key}",
            lambda i: int((i.gate.get("pauses_total") or {}).get(reason, 0)),
            state_class="total_increasing",
            icon="mdi:pause-circle-outline",
            category=_DIAG,
        ),
        Entity(
            f"paused_seconds_{key}",
            "sensor",
            f"Paused time ({reason})",
            f"gate/paused_seconds/{key}",
            lambda i: _round(float((i.gate.get("paused_seconds") or {}).get(reason, 0.0))),
            device_class="duration",
            state_class="total_increasing",
            unit="s",
            icon="mdi:timer-pause",
            category=_DIAG,
            precision=0,
            on_change=False,
        ),
    ]


def entities(inputs: Inputs) -> list[Entity]:
    """Every entity for these inputs: the static ones, then per service, then per pause reason."""
    out = [*STATIC, *_controls(inputs)]
    for name in sorted(inputs.snapshot.services):
        out += _service_entities(name)
    for reason in pause_reasons(inputs.gate):
        out += _pause_entities(reason)
    return out
