"""Home Assistant MQTT discovery payloads (pure functions, no I/O).

Device-based discovery (Home Assistant 2024.11+): one retained JSON message at
``<prefix>/device/<node_id>/config`` holding the device (``dev``), the origin (``o``) and every
entity under ``cmps``. Per-entity discovery (older Home Assistant): one retained message per
entity at ``<prefix>/<platform>/<node_id>/<key>/config``, each carrying ``dev`` and ``o``.
Options use Home Assistant's abbreviations (``uniq_id``, ``stat_t``, ``avty_t`` ...).

Removal: a component of the device message reduced to ``{"p": platform}`` is removed by Home
Assistant; a per-entity config is removed by an empty retained payload.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .entity_model import Entity, Topics

_EXPIRING = frozenset({"sensor", "binary_sensor"})


@dataclass(frozen=True)
class DeviceInfo:
    """The device the entities belong to, and the software that announces them."""

    node_id: str
    """This box's id."""
    name: str
    """Device name shown in Home Assistant."""
    model: str = "genie-supervisor"
    """Device model."""
    manufacturer: str = "genie-supervisor"
    """Device manufacturer."""
    sw_version: str = ""
    """Supervisor version."""
    origin_url: str | None = None
    """Support URL of the origin, where there is one."""

    def device(self) -> dict[str, Any]:
        """The ``dev`` mapping."""
        dev: dict[str, Any] = {
            "ids": [unique_prefix(self.node_id)],
            "name": self.name,
            "mdl": self.model,
            "mf": self.manufacturer,
        }
        if self.sw_version:
            dev["sw"] = self.sw_version
        return dev

    def origin(self) -> dict[str, Any]:
        """The ``o`` mapping."""
        o: dict[str, Any] = {"name": "genie-supervisor"}
        if self.sw_version:
            o["sw"] = self.sw_version
        if self.origin_url:
            o["url"] = self.origin_url
        return o


def unique_prefix(node_id: str) -> str:
    """Prefix of every unique_id of the node (and its device identifier)."""
    return f"genie_{node_id}"


def expire_after(publish_interval_s: float) -> int:
    """Seconds after which Home Assistant marks a sensor stale: about three refresh intervals."""
    return max(1, math.ceil(3 * publish_interval_s))


def component(entity: Entity, topics: Topics, *, expire_s: int | None) -> dict[str, Any]:
    """One entity's discovery options (without ``dev`` / ``o``)."""
    cfg: dict[str, Any] = {
        "p": entity.platform,
        "name": entity.name,
        "uniq_id": f"{unique_prefix(topics.node_id)}_{entity.key}",
        "avty_t": topics.availability,
    }
    if entity.state is not None:
        cfg["stat_t"] = topics.state(entity.state)
    if entity.command is not None:
        cfg["cmd_t"] = topics.state(entity.command)
    if entity.attributes_topic is not None:
        cfg["json_attr_t"] = topics.state(entity.attributes_topic)
    optional = {
        "dev_cla": entity.device_class,
        "stat_cla": entity.state_class,
        "unit_of_meas": entity.unit,
        "ic": entity.icon,
        "ent_cat": entity.category,
        "sug_dsp_prc": entity.precision,
    }
    cfg.update((key, value) for key, value in optional.items() if value is not None)
    if expire_s is not None and entity.platform in _EXPIRING:
        cfg["exp_aft"] = expire_s
    cfg.update(entity.extra)
    return cfg


def device_config(
    entities: Iterable[Entity],
    topics: Topics,
    info: DeviceInfo,
    *,
    expire_s: int | None,
    removed: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The device-based discovery message; `removed` maps component ids to remove to their platform."""
    cmps: dict[str, Any] = {key: {"p": platform} for key, platform in sorted((removed or {}).items())}
    for e in entities:
        cmps[e.key] = component(e, topics, expire_s=expire_s)
    return {"dev": info.device(), "o": info.origin(), "cmps": cmps}


def entity_configs(
    entities: Iterable[Entity], topics: Topics, info: DeviceInfo, *, expire_s: int | None
) -> dict[str, dict[str, Any]]:
    """Per-entity discovery messages by topic (each one with its own ``dev`` and ``o``)."""
    out: dict[str, dict[str, Any]] = {}
    for e in entities:
        cfg = component(e, topics, expire_s=expire_s)
        del cfg["p"]
        cfg["dev"] = info.device()
        cfg["o"] = info.origin()
        out[topics.entity_config(e.platform, e.key)] = cfg
    return out


def signature(entities: Iterable[Entity]) -> str:
    """Changes whenever the discovery messages would change (entities, platforms, options)."""
    return json.dumps([[e.key, e.platform, dict(e.extra)] for e in entities], sort_keys=True, default=str)


def retained_components(payload: bytes) -> dict[str, str]:
    """Component ids and platforms of a retained device message (stubs included); {} if unreadable."""
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return {}
    cmps = data.get("cmps") if isinstance(data, dict) else None
    if not isinstance(cmps, dict):
        return {}
    return {
        str(k): str(v.get("p") or v.get("platform"))
        for k, v in cmps.items()
        if isinstance(v, dict) and (v.get("p") or v.get("platform"))
    }


@dataclass(frozen=True)
class Cleanup:
    """What to do about retained discovery found at start-up."""

    clear_topics: tuple[str, ...]
    """Retained discovery topics to clear with an empty retained payload."""
    removed: Mapping[str, str]
    """Device-message components to remove (id -> platform), sent as ``{"p": platform}`` stubs."""


def plan_cleanup(
    retained: Mapping[str, bytes], topics: Topics, current: Iterable[Entity], *, per_entity: bool
) -> Cleanup:
    """Which of our retained discovery messages are stale, given what we publish now.

    `retained` maps topic to payload for every retained message seen on our device topic and
    our per-entity topics. In device mode every per-entity message is stale and device
    components we no longer have are removed; in per-entity mode the device message and the
    per-entity messages we no longer have are stale.
    """
    current = list(current)
    clear: list[str] = []
    removed: dict[str, str] = {}
    wanted = {topics.entity_config(e.platform, e.key) for e in current}
    keys = {e.key for e in current}
    for topic, body in sorted(retained.items()):
        if not body:
            continue
        if topic == topics.device_config:
            if per_entity:
                clear.append(topic)
            else:
                cmps = retained_components(body)
                stale = {k: p for k, p in cmps.items() if k not in keys}
                # a stub already in the retained message did its job when it was first seen
                removed.update({k: p for k, p in stale.items() if not _is_stub(body, k)})
        elif not per_entity or topic not in wanted:
            clear.append(topic)
    return Cleanup(tuple(clear), removed)


def _is_stub(body: bytes, key: str) -> bool:
    try:
        cfg = json.loads(body)["cmps"][key]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(cfg, dict) and set(cfg) <= {"p", "platform"}
