"""The Home Assistant entities of the current inputs: the fixed table plus the ones that come and go.

An ``Entity`` is a row of the table in ``docs/mqtt.md``. ``entities(inputs)`` lists the entities
for the current inputs: the fixed ones (``entity_table.STATIC``), the policy select and thermal
limit, then a pair per watched service and per pause reason (they come and go with the snapshot);
``Entity.render(inputs)`` gives each one's state payload. The types (``Entity``, ``Inputs``,
``Topics``, ``CommandRefusal``) live in ``entity_model`` and are re-exported here. Nothing here
does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .entity_model import KNOWN_PAUSE_REASONS, OFF, ON, CommandRefusal, Entity, Inputs, Kind, Topics
from .entity_table import _DIAG, MIB, STATIC, _round

__all__ = ["STATIC", "CommandRefusal", "Entity", "Inputs", "Topics", "entities", "pause_reasons", "policy_choices"]


def _selected_policy(i: Inputs) -> str | None:
    return i.active_policy if i.active_policy is not None else i.snapshot.policy_name


def pause_reasons(gate: Mapping[str, Any]) -> list[str]:
    """Reasons that get pause counters: the known ones plus any the gate has seen."""
    seen = set(gate.get("pauses_total") or {}) | set(gate.get("paused_seconds") or {})
    return [*KNOWN_PAUSE_REASONS, *sorted(seen - set(KNOWN_PAUSE_REASONS))]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name.lower())


def policy_choices(inputs: Inputs) -> list[str]:
    """Options of the policy select: never empty (Home Assistant refuses a select without options)."""
    options = list(dict.fromkeys(inputs.policy_options))
    current = _selected_policy(inputs)
    if not options:
        options = [current or "default"]
    return options


def _controls(inputs: Inputs) -> list[Entity]:
    low, high = inputs.thermal_limit_range
    select = Kind("select", icon="mdi:script-text", category="config", extra={"ops": policy_choices(inputs)})
    number = Kind("number", device_class="temperature", unit="°C", category="config")
    return [
        select("policy_select", "Policy file", "policy/selected", _selected_policy, command="policy/set"),
        number(
            "thermal_soft_limit",
            "Thermal soft limit",
            "thermal/soft_limit",
            lambda i: i.thermal_soft_limit,
            "mdi:thermometer-chevron-up",
            command="thermal/soft_limit/set",
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
        MIB(
            f"service_{key}_memory",
            f"{name} memory",
            f"service/{key}/memory",
            lambda i: _round(o.rss_mb, 0) if (o := obs(i)) is not None else None,
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
