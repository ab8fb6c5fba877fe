"""The building blocks of the Home Assistant entities: the node's topics, the inputs, the entity type.

``Topics`` names every topic of one node; ``Inputs`` is what every entity's state is computed from
at one moment; ``Entity`` is one row of the table in ``docs/mqtt.md`` and renders its own state and
attributes payloads (``payload`` turns a value into what Home Assistant reads); a ``Kind`` holds what
a family of entities shares and builds its members. The value sets of
the enum sensors and the payload constants live here too. The table itself is in ``entity_table``
(the fixed entities) and ``entities`` (the ones that come and go). Nothing here does I/O.
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


class Kind:
    """What a family of entities shares (platform, classes, unit, icon, ...); calling it builds one member."""

    def __init__(self, platform: str = "sensor", **shared: Any) -> None:
        self.platform = platform
        """The members' ``Entity.platform``."""
        self.shared = shared
        """``Entity`` fields every member has (device_class, state_class, unit, icon, category, precision, extra)."""

    def __call__(
        self,
        key: str,
        name: str,
        state: str | None = None,
        value: Render | None = None,
        icon: str | None = None,
        **own: Any,
    ) -> Entity:
        """The entity `key` of this kind (`icon` overrides the kind's when given); `own` sets any other
        ``Entity`` field or overrides the kind's."""
        if icon is not None:
            own["icon"] = icon
        return Entity(key, self.platform, name, state, value, **{**self.shared, **own})


def payload(value: Any) -> str:
    """A state value as Home Assistant reads it."""
    if value is None:
        return NONE
    if isinstance(value, bool):
        return ON if value else OFF
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if value == value else NONE
    return str(value)
