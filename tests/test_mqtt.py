"""Home Assistant over MQTT: discovery, availability, live state, commands and reconnection.

The broker tests run a real Mosquitto on a free loopback port (skipped when the binary is
absent). The StateStore, DecodeGate, Arbiter and VoiceHints are the real components; the app's
command callbacks are a recording fake (the app boundary).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiomqtt
import anyio
import pytest
from anyio.abc import SocketStream

from genie_supervisor.arbiter import Arbiter, DecodeGate
from genie_supervisor.config import MqttConfig
from genie_supervisor.events import EngineStats, ServiceObservation, TelemetrySample, VoiceActivity
from genie_supervisor.mqtt import MqttBridge, MqttCommands, Topics
from genie_supervisor.mqtt.commands import CommandError, parse_command
from genie_supervisor.mqtt.discovery import (
    DeviceInfo,
    device_config,
    entity_configs,
    plan_cleanup,
)
from genie_supervisor.mqtt.entities import Inputs, entities
from genie_supervisor.mqtt.publisher import Message, StatePublisher
from genie_supervisor.policy.schema import builtin_policy
from genie_supervisor.state import StateStore
from genie_supervisor.voice import VoiceHints
from tests.broker import Mosquitto, needs_broker
from tests.net import HOST, free_port

NODE = "testbox"

# -- what Home Assistant accepts ------------------------------------------------------------------
ABBREVIATIONS = {
    "p": "platform",
    "uniq_id": "unique_id",
    "stat_t": "state_topic",
    "cmd_t": "command_topic",
    "avty_t": "availability_topic",
    "json_attr_t": "json_attributes_topic",
    "dev_cla": "device_class",
    "stat_cla": "state_class",
    "unit_of_meas": "unit_of_measurement",
    "ic": "icon",
    "ent_cat": "entity_category",
    "exp_aft": "expire_after",
    "sug_dsp_prc": "suggested_display_precision",
    "ops": "options",
    "pl_on": "payload_on",
    "pl_off": "payload_off",
    "stat_on": "state_on",
    "stat_off": "state_off",
    "pl_prs": "payload_press",
    "val_tpl": "value_template",
    "dev": "device",
    "o": "origin",
    "cmps": "components",
}
DEVICE_ABBREVIATIONS = {
    "ids": "identifiers",
    "mf": "manufacturer",
    "mdl": "model",
    "sw": "sw_version",
    "name": "name",
    "hw": "hw_version",
}
COMMON = {
    "platform",
    "unique_id",
    "name",
    "availability_topic",
    "icon",
    "entity_category",
    "json_attributes_topic",
    "device",
    "origin",
}
ALLOWED = {
    "sensor": COMMON
    | {
        "state_topic",
        "device_class",
        "state_class",
        "unit_of_measurement",
        "expire_after",
        "suggested_display_precision",
        "options",
        "value_template",
    },
    "binary_sensor": COMMON
    | {"state_topic", "device_class", "payload_on", "payload_off", "expire_after", "value_template"},
    "select": COMMON | {"state_topic", "command_topic", "options"},
    "switch": COMMON
    | {"state_topic", "command_topic", "payload_on", "payload_off", "state_on", "state_off", "device_class"},
    "button": COMMON | {"command_topic", "payload_press"},
    "number": COMMON
    | {"state_topic", "command_topic", "min", "max", "step", "mode", "device_class", "unit_of_measurement"},
}
UNITS = {
    "temperature": {"°C", "°F", "K"},
    "data_size": {"B", "kB", "MB", "MiB", "GB", "GiB"},
    "duration": {"d", "h", "min", "s", "ms"},
    "power": {"W", "kW"},
}
BINARY_CLASSES = {"running", "connectivity", "problem"}


def expand(cfg: dict[str, Any]) -> dict[str, Any]:
    """A discovery mapping with Home Assistant's abbreviations written out."""
    out = {ABBREVIATIONS.get(k, k): v for k, v in cfg.items()}
    for key in ("device",):
        if key in out:
            out[key] = {DEVICE_ABBREVIATIONS.get(k, k): v for k, v in out[key].items()}
    return out


def check_component(cfg: dict[str, Any], *, availability: str, expire_s: int) -> None:
    """Assert that one (expanded) component config is what Home Assistant requires of its platform."""
    platform = cfg["platform"]
    assert platform in ALLOWED, platform
    unknown = set(cfg) - ALLOWED[platform]
    assert not unknown, f"{cfg['unique_id']}: options {platform} does not take: {unknown}"
    assert "object_id" not in cfg
    assert cfg["unique_id"] and cfg["name"]
    assert cfg["availability_topic"] == availability
    assert cfg.get("entity_category") in (None, "diagnostic", "config")
    if platform in ("sensor", "binary_sensor"):
        assert cfg["state_topic"]
        assert cfg["expire_after"] == expire_s
        assert cfg.get("entity_category") != "config", "sensors cannot be config entities"
    if platform == "sensor":
        assert cfg.get("state_class") in (None, "measurement", "total", "total_increasing")
        if cfg.get("device_class") == "enum":
            assert cfg["options"] and "unit_of_measurement" not in cfg and "state_class" not in cfg
        if cfg.get("device_class") in UNITS:
            assert cfg["unit_of_measurement"] in UNITS[cfg["device_class"]]
    if platform == "binary_sensor":
        assert ("payload_on" in cfg and "payload_off" in cfg) or "value_template" in cfg
        assert cfg.get("device_class") in BINARY_CLASSES
    if platform in ("select", "switch", "button", "number"):
        assert cfg["command_topic"]
    if platform == "select":
        assert cfg["options"] and all(isinstance(o, str) for o in cfg["options"])
    if platform == "number":
        assert cfg["min"] < cfg["max"] and cfg["step"] > 0


def check_device_message(payload: dict[str, Any], *, availability: str, expire_s: int) -> dict[str, Any]:
    """Assert a device discovery message is valid; returns its components, expanded."""
    msg = expand(payload)
    dev = msg["device"]
    assert dev["identifiers"] and dev["name"] and dev["model"] and dev["manufacturer"] and dev["sw_version"]
    assert msg["origin"]["name"] and msg["origin"]["sw"]
    cmps = {key: expand(cfg) for key, cfg in msg["components"].items()}
    ids = [c["unique_id"] for c in cmps.values() if len(c) > 1]
    assert len(ids) == len(set(ids)), "unique ids repeat"
    for cfg in cmps.values():
        if set(cfg) != {"platform"}:  # a removal stub carries only the platform
            check_component(cfg, availability=availability, expire_s=expire_s)
    return cmps


# -- unit tests of the pure parts -----------------------------------------------------------------
def sample_inputs(**kw: Any) -> Inputs:
    """Inputs with telemetry, two services, engine stats and a pause counter."""
    store = StateStore()
    store.publish(
        TelemetrySample(
            "simulated",
            temps_c={"cpu": 50.0, "gpu": 48.5},
            mem_available_mb=4000.0,
            power_w={"VDD_IN": 7.25},
            gpu_load_pct=30.0,
            swap_used_mb=12.0,
        )
    )
    store.publish(ServiceObservation("whisper", True, rss_mb=800.0))
    store.publish(ServiceObservation("piper", None))
    store.publish(EngineStats("decoding", model="smollm2", decode_tps=21.5, tokens_total=42))
    store.set_policy("default", None)
    gate = {
        "mode": "paused",
        "reasons": ["stt"],
        "pauses_total": {"stt": 2, "stt_unknown": 1},
        "paused_seconds": {"stt": 1.5},
    }
    return Inputs(store.snapshot(), gate, policy_options=("default", "orin-nano-8gb"), **kw)


TOPICS = Topics.make("genie", "homeassistant", NODE)
INFO = DeviceInfo(NODE, "Genie test", sw_version="0.1.0")


def test_device_discovery_message_is_valid_for_every_component() -> None:
    """The device message holds dev, o and a valid config for every entity, services and reasons included."""
    ents = entities(sample_inputs())
    msg = json.loads(json.dumps(device_config(ents, TOPICS, INFO, expire_s=15)))
    cmps = check_device_message(msg, availability="genie/testbox/availability", expire_s=15)
    platforms = {cfg["platform"] for cfg in cmps.values()}
    assert platforms == {"sensor", "binary_sensor", "select", "switch", "button", "number"}
    for key in (
        "llm_state",
        "gate_reason",
        "decode_tps",
        "first_token_ms",
        "requests_in_flight",
        "requests_queued",
        "tokens_total",
        "model",
        "model_memory",
        "kv_memory",
        "scratch_memory",
        "start_to_ready",
        "stt_active",
        "tts_active",
        "gpu_temperature",
        "cpu_temperature",
        "gpu_load",
        "power",
        "ram_available",
        "swap_used",
        "active_policy",
        "policy_error",
        "platform",
        "service_whisper_up",
        "service_whisper_memory",
        "service_piper_up",
        "pauses_stt",
        "paused_seconds_stt",
        "pauses_stt_unknown",
        "policy_select",
        "llm_enabled",
        "reload_policy",
        "unload_model",
        "thermal_soft_limit",
    ):
        assert key in cmps, key
    assert cmps["tokens_total"]["state_class"] == "total_increasing"
    assert cmps["service_whisper_up"]["device_class"] == "connectivity"
    assert cmps["policy_error"]["device_class"] == "problem" and cmps["policy_error"]["json_attributes_topic"]
    assert cmps["model_memory"]["entity_category"] == "diagnostic"
    assert cmps["start_to_ready"]["unit_of_measurement"] == "s" and cmps["start_to_ready"]["device_class"] == "duration"
    assert cmps["policy_select"]["options"] == ["default", "orin-nano-8gb"]


def test_per_entity_discovery_messages_are_valid() -> None:
    """Per-entity mode gives one valid config per entity, each with its device and origin."""
    ents = entities(sample_inputs())
    configs = entity_configs(ents, TOPICS, INFO, expire_s=15)
    assert len(configs) == len(ents)
    for topic, cfg in configs.items():
        platform = topic.split("/")[1]
        full = expand({"p": platform, **cfg})
        assert topic == f"homeassistant/{platform}/testbox/{full['unique_id'].removeprefix('genie_testbox_')}/config"
        assert full["device"]["identifiers"] == ["genie_testbox"] and full["origin"]["name"]
        check_component(full, availability="genie/testbox/availability", expire_s=15)


def test_cleanup_plans_removal_of_our_stale_discovery_only() -> None:
    """Stale device components become stubs, per-entity leftovers are cleared, current ones stay."""
    ents = entities(sample_inputs())
    old_device = json.dumps(
        {
            "dev": {},
            "o": {},
            "cmps": {
                "llm_state": {"p": "sensor"},
                "old_sensor": {"p": "sensor", "stat_t": "x"},
                "gone_before": {"p": "switch"},
            },
        }
    ).encode()
    retained = {
        TOPICS.device_config: old_device,
        "homeassistant/sensor/testbox/llm_state/config": b"{}",
        "homeassistant/sensor/testbox/ancient/config": b"{}",
        "homeassistant/sensor/testbox/already_cleared/config": b"",
    }
    device_mode = plan_cleanup(retained, TOPICS, ents, per_entity=False)
    assert device_mode.removed == {"old_sensor": "sensor"}
    assert set(device_mode.clear_topics) == {
        "homeassistant/sensor/testbox/llm_state/config",
        "homeassistant/sensor/testbox/ancient/config",
    }
    entity_mode = plan_cleanup(retained, TOPICS, ents, per_entity=True)
    assert entity_mode.removed == {}
    assert set(entity_mode.clear_topics) == {TOPICS.device_config, "homeassistant/sensor/testbox/ancient/config"}


def test_state_publisher_sends_changes_once_per_interval_and_the_last_value_wins() -> None:
    """A topic changing faster than the minimum interval is held back and then sent with its latest value."""
    now = [100.0]
    pub = StatePublisher(min_interval_s=1.0, clock=lambda: now[0])

    def msgs(value: str) -> dict[str, Message]:
        return {"t/a": Message("t/a", value), "t/slow": Message("t/slow", value, on_change=False)}

    assert [m.payload for m in pub.refresh(msgs("1"))] == ["1", "1"]
    now[0] = 100.2
    out, due = pub.changes(msgs("2"))
    assert out == [] and due == pytest.approx(101.0)
    now[0] = 100.5
    assert pub.changes(msgs("3")) == ([], pytest.approx(101.0))
    now[0] = 101.0
    out, due = pub.changes(msgs("3"))
    assert [(m.topic, m.payload) for m in out] == [("t/a", "3")] and due is None
    assert pub.changes(msgs("3")) == ([], None)


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("policy/set", b"no-such-policy"),
        ("llm/enabled/set", b"maybe"),
        ("policy/reload", b"now"),
        ("thermal/soft_limit/set", b"hot"),
        ("thermal/soft_limit/set", b"500"),
        ("thermal/soft_limit/set", b"nan"),
        ("voice/events", b"{not json"),
        ("voice/events", b"[1, 2]"),
        ("llm/enabled/set", b"\xff\xfe"),
    ],
)
def test_malformed_commands_are_refused(path: str, payload: bytes) -> None:
    """Every malformed command payload raises CommandError."""
    with pytest.raises(CommandError):
        parse_command(path, f"genie/testbox/{path}", payload, sample_inputs())


# -- a real broker (tests/broker.py, the `broker` fixture of tests/conftest.py) -------------------
class Recorder:
    """Messages of one subscriber connection, awaitable by predicate."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes, bool]] = []
        self._changed = anyio.Event()

    def add(self, topic: str, payload: bytes, retain: bool) -> None:
        self.messages.append((topic, payload, retain))
        self._changed.set()
        self._changed = anyio.Event()

    def mark(self) -> int:
        """Position to search from for messages that come later."""
        return len(self.messages)

    async def wait_for(
        self, topic: str, pred: Callable[[bytes], bool] = lambda p: True, *, start: int = 0, within_s: float = 5.0
    ) -> bytes:
        """The first payload on `topic` at or after `start` that matches `pred`."""
        with anyio.fail_after(within_s):
            while True:
                for t, p, _ in self.messages[start:]:
                    if t == topic and pred(p):
                        return p
                await self._changed.wait()

    def last(self, topic: str) -> bytes | None:
        """The latest payload seen on `topic`."""
        found = [p for t, p, _ in self.messages if t == topic]
        return found[-1] if found else None


@asynccontextmanager
async def subscriber(port: int, *filters: str, **client_kw: Any) -> AsyncIterator[tuple[Recorder, aiomqtt.Client]]:
    """A second client that records everything on `filters` (subscribed before this yields)."""
    rec = Recorder()
    async with aiomqtt.Client(HOST, port, **client_kw) as client, anyio.create_task_group() as tg:
        await client.subscribe([(f, 1) for f in filters])

        async def pump() -> None:
            try:
                async for msg in client.messages:
                    payload = msg.payload if isinstance(msg.payload, bytes) else str(msg.payload).encode()
                    rec.add(msg.topic.value, payload, msg.retain)
            except aiomqtt.MqttError:
                pass  # the broker went away (the restart test stops it)

        tg.start_soon(pump)
        yield rec, client
        tg.cancel_scope.cancel()


class FakeApp:
    """The app's side of the commands: records calls and keeps the controls' state."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.calls: list[tuple[str, Any]] = []
        self.changed = anyio.Event()
        self.policy = "default"
        self.enabled = True
        self.limit = 80.0
        self.hints = VoiceHints(store)

    def _record(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        self.changed.set()
        self.changed = anyio.Event()

    async def wait_calls(self, n: int, within_s: float = 5.0) -> list[tuple[str, Any]]:
        """Wait until `n` calls were recorded."""
        with anyio.fail_after(within_s):
            while len(self.calls) < n:
                await self.changed.wait()
        return self.calls

    async def select_policy(self, name: str) -> None:
        self.policy = name
        self.store.set_policy(name, None)
        self._record("select_policy", name)

    async def set_llm_enabled(self, on: bool) -> None:
        self.enabled = on
        self._record("set_llm_enabled", on)

    async def reload_policy(self) -> None:
        self._record("reload_policy")

    async def unload_model(self) -> None:
        self._record("unload_model")

    async def set_thermal_soft_limit(self, c: float) -> None:
        self.limit = c
        self._record("set_thermal_soft_limit", c)

    async def voice_hint(self, payload: dict[str, Any]) -> None:
        self.hints.handle(payload, "mqtt")
        self._record("voice_hint", payload)

    def commands(self) -> MqttCommands:
        """The MqttCommands the bridge gets."""
        return MqttCommands(
            select_policy=self.select_policy,
            set_llm_enabled=self.set_llm_enabled,
            reload_policy=self.reload_policy,
            unload_model=self.unload_model,
            set_thermal_soft_limit=self.set_thermal_soft_limit,
            voice_hint=self.voice_hint,
            policy_options=lambda: ["default", "orin-nano-8gb"],
            active_policy=lambda: self.policy,
            llm_enabled=lambda: self.enabled,
            thermal_soft_limit=lambda: self.limit,
        )


def mqtt_config(url: str, **kw: Any) -> MqttConfig:
    """A test config: fast refresh and reconnection."""
    return MqttConfig(**{"url": url, "publish_interval_s": 2.0, "reconnect_max_s": 1.0, "startup_wait_s": 5.0, **kw})


@asynccontextmanager
async def running_bridge(
    config: MqttConfig,
    store: StateStore | None = None,
    *,
    make_app: Callable[[StateStore], FakeApp] = FakeApp,
) -> AsyncIterator[tuple[MqttBridge, StateStore, FakeApp]]:
    """A bridge (with a real gate and arbiter on the built-in policy) started as the daemon starts it."""
    store = store or StateStore()
    store.publish(TelemetrySample("simulated", temps_c={"cpu": 45.0, "gpu": 44.0}, mem_available_mb=5000.0))
    store.set_policy("default", None)
    app = make_app(store)
    arbiter = Arbiter(DecodeGate())
    policy = builtin_policy()
    bridge = MqttBridge(config, NODE, store, gate_metrics=arbiter.gate.metrics, commands=app.commands())
    arbiter.add_listener(lambda _decision: bridge.notify())
    async with anyio.create_task_group() as tg:
        await tg.start(arbiter.run, store, lambda: policy)
        await tg.start(bridge.run)
        yield bridge, store, app
        tg.cancel_scope.cancel()


T = Topics.make("genie", "homeassistant", NODE)
AVAIL = T.availability


def is_(value: str) -> Callable[[bytes], bool]:
    """Predicate: the payload equals `value`."""
    return lambda p: p == value.encode()


@asynccontextmanager
async def online_bridge(
    broker: Mosquitto, *, make_app: Callable[[StateStore], FakeApp] = FakeApp
) -> AsyncIterator[tuple[Recorder, aiomqtt.Client, MqttBridge, StateStore, FakeApp]]:
    """A recorder of genie/# with its client, and a bridge on `broker` that has announced itself online."""
    async with (
        subscriber(broker.port, "genie/#") as (rec, client),
        running_bridge(mqtt_config(broker.url), make_app=make_app) as (bridge, store, app),
    ):
        await rec.wait_for(AVAIL, is_("online"))
        yield rec, client, bridge, store, app


@needs_broker
@pytest.mark.timeout(30)
async def test_discovery_availability_and_state_follow_the_store(broker: Mosquitto) -> None:
    """A subscriber sees valid discovery, `online`, and states that change with the store."""
    async with subscriber(broker.port, "homeassistant/#", "genie/#") as (rec, _):
        async with running_bridge(mqtt_config(broker.url)) as (bridge, store, _app):
            assert bridge.connected
            cmps = check_device_message(json.loads(await rec.wait_for(T.device_config)), availability=AVAIL, expire_s=6)
            await rec.wait_for(AVAIL, is_("online"))
            gpu = T.state("platform/gpu_temperature")
            assert cmps["gpu_temperature"]["state_topic"] == gpu
            await rec.wait_for(gpu, is_("44"))
            await rec.wait_for(T.state("voice/stt"), is_("OFF"))

            store.publish(TelemetrySample("simulated", temps_c={"cpu": 45.0, "gpu": 71.5}))
            await rec.wait_for(gpu, is_("71.5"), within_s=3)

            store.publish(VoiceActivity("stt", True, "proxy:whisper"))
            await rec.wait_for(T.state("voice/stt"), is_("ON"), within_s=3)
            await rec.wait_for(T.state("gate/mode"), is_("paused"), within_s=3)
            await rec.wait_for(T.state("gate/reason"), is_("stt"), within_s=3)

            mark = rec.mark()
            store.publish(ServiceObservation("whisper", False, reason="process not found"))
            new = json.loads(await rec.wait_for(T.device_config, start=mark, within_s=3))
            assert "service_whisper_up" in check_device_message(new, availability=AVAIL, expire_s=6)
            await rec.wait_for(T.state("service/whisper/up"), is_("OFF"), within_s=3)
            attrs = await rec.wait_for(T.state("service/whisper/up/attributes"), within_s=3)
            assert json.loads(attrs)["reason"] == "process not found"


@needs_broker
@pytest.mark.timeout(30)
async def test_voice_hint_over_mqtt_reaches_the_store(broker: Mosquitto) -> None:
    """A JSON hint on the voice topic turns STT on; a non-JSON one calls nothing."""
    async with online_bridge(broker) as (rec, client, _bridge, store, app):
        await client.publish(T.voice_events, b"not json", qos=1)
        await client.publish(T.voice_events, json.dumps({"service": "stt", "event": "start"}), qos=1)
        calls = await app.wait_calls(1)
        assert calls == [("voice_hint", {"service": "stt", "event": "start"})]
        assert store.snapshot().voice.stt_active
        await rec.wait_for(T.state("voice/stt"), is_("ON"), within_s=3)


@needs_broker
@pytest.mark.timeout(30)
async def test_commands_call_the_app_and_malformed_ones_call_nothing(broker: Mosquitto) -> None:
    """Select, switch, buttons and number call the app; bad payloads are ignored; states confirm."""
    async with online_bridge(broker) as (rec, client, _bridge, _store, app):
        await rec.wait_for(T.state("policy/selected"), is_("default"))

        async def send(path: str, payload: str | bytes) -> None:
            await client.publish(T.state(path), payload, qos=1)

        # malformed first: each is rejected before the valid command behind it is queued
        for path, bad in [
            ("policy/set", "nope"),
            ("llm/enabled/set", "maybe"),
            ("policy/reload", "x"),
            ("llm/unload", ""),
            ("thermal/soft_limit/set", "warm"),
            ("thermal/soft_limit/set", "1000"),
            ("voice/events", "{"),
        ]:
            await send(path, bad)
        await send("policy/set", "orin-nano-8gb")
        assert await app.wait_calls(1) == [("select_policy", "orin-nano-8gb")]
        await rec.wait_for(T.state("policy/selected"), is_("orin-nano-8gb"), within_s=3)
        await rec.wait_for(T.state("policy/name"), is_("orin-nano-8gb"), within_s=3)

        await send("llm/enabled/set", "OFF")
        await send("llm/enabled/set", "ON")
        await send("policy/reload", "PRESS")
        await send("llm/unload", "PRESS")
        await send("thermal/soft_limit/set", "72.5")
        calls = await app.wait_calls(6)
        assert calls[1:] == [
            ("set_llm_enabled", False),
            ("set_llm_enabled", True),
            ("reload_policy", None),
            ("unload_model", None),
            ("set_thermal_soft_limit", 72.5),
        ]
        await rec.wait_for(T.state("thermal/soft_limit"), is_("72.5"), within_s=3)
        await rec.wait_for(T.state("llm/enabled"), is_("ON"), within_s=3)
        assert len(app.calls) == 6


@needs_broker
@pytest.mark.timeout(30)
async def test_clean_shutdown_publishes_offline(broker: Mosquitto) -> None:
    """Cancelling the bridge leaves a retained `offline`."""
    async with subscriber(broker.port, AVAIL) as (rec, _):
        async with running_bridge(mqtt_config(broker.url, protocol="5")):
            await rec.wait_for(AVAIL, is_("online"))
            mark = rec.mark()
        await rec.wait_for(AVAIL, is_("offline"), start=mark)
    async with subscriber(broker.port, AVAIL) as (late, _):
        assert await late.wait_for(AVAIL) == b"offline"


@needs_broker
@pytest.mark.timeout(30)
async def test_stale_retained_discovery_of_ours_is_removed_at_start(broker: Mosquitto) -> None:
    """Old components get removal stubs, old per-entity configs are cleared, others' are untouched."""
    old = {
        "dev": {"ids": ["genie_testbox"]},
        "o": {"name": "genie-supervisor"},
        "cmps": {"old_sensor": {"p": "sensor", "uniq_id": "genie_testbox_old_sensor", "stat_t": "x"}},
    }
    async with subscriber(broker.port, "homeassistant/#") as (rec, client):
        await client.publish(T.device_config, json.dumps(old), qos=1, retain=True)
        await client.publish("homeassistant/sensor/testbox/old_thing/config", b"{}", qos=1, retain=True)
        await client.publish("homeassistant/sensor/otherbox/old_thing/config", b"{}", qos=1, retain=True)
        await rec.wait_for("homeassistant/sensor/otherbox/old_thing/config")
        mark = rec.mark()
        async with running_bridge(mqtt_config(broker.url)):
            await rec.wait_for("homeassistant/sensor/testbox/old_thing/config", is_(""), start=mark)
            new = json.loads(await rec.wait_for(T.device_config, lambda p: b"llm_state" in p, start=mark))
            assert new["cmps"]["old_sensor"] == {"p": "sensor"}
            assert all(t != "homeassistant/sensor/otherbox/old_thing/config" for t, _, _ in rec.messages[mark:])


@needs_broker
@pytest.mark.timeout(30)
async def test_per_entity_mode_and_home_assistant_birth_republish(broker: Mosquitto) -> None:
    """Per-entity mode clears the device message, publishes valid configs, and re-sends them when HA comes online."""
    async with subscriber(broker.port, "homeassistant/#", "genie/#") as (rec, client):
        await client.publish(T.device_config, b'{"dev": {}, "o": {}, "cmps": {}}', qos=1, retain=True)
        await rec.wait_for(T.device_config)
        mark = rec.mark()
        async with running_bridge(mqtt_config(broker.url, per_entity_discovery=True)):
            await rec.wait_for(AVAIL, is_("online"), start=mark)
            assert rec.last(T.device_config) == b""
            temp = T.entity_config("sensor", "gpu_temperature")
            cfg = json.loads(await rec.wait_for(temp, start=mark))
            check_component(expand({"p": "sensor", **cfg}), availability=AVAIL, expire_s=6)
            mark = rec.mark()
            await client.publish("homeassistant/status", b"online", qos=1)
            await rec.wait_for(temp, start=mark, within_s=5)


class Relay:
    """A TCP relay in front of the broker that the test can close and reopen on the same port."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._scope: anyio.CancelScope | None = None

    async def open(self, tg: anyio.abc.TaskGroup) -> None:
        """Listen (again) on the relay port."""
        listener = await anyio.create_tcp_listener(local_host=HOST, local_port=self.port)
        scope = anyio.CancelScope()
        self._scope = scope

        async def serve() -> None:
            with scope:
                async with listener, anyio.create_task_group() as conns:
                    await listener.serve(self._pipe, conns)

        tg.start_soon(serve)

    def close(self) -> None:
        """Stop listening and drop every relayed connection."""
        assert self._scope is not None
        self._scope.cancel()

    async def _pipe(self, down: SocketStream) -> None:
        async with down:
            try:
                up = await anyio.connect_tcp(HOST, self.upstream_port)
            except OSError:
                return  # broker down: the client sees its connection closed
            async with up, anyio.create_task_group() as tg:
                tg.start_soon(self._copy, down, up, tg.cancel_scope)
                tg.start_soon(self._copy, up, down, tg.cancel_scope)

    @staticmethod
    async def _copy(src: SocketStream, dst: SocketStream, both: anyio.CancelScope) -> None:
        try:
            async for chunk in src:
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        both.cancel()  # one side closed: close the other


@needs_broker
@pytest.mark.timeout(60)
async def test_broker_restart_leaves_offline_then_reconnects_and_republishes(tmp_path: Path) -> None:
    """While the broker is down the will leaves `offline`; once it is back the bridge republishes and is `online`."""
    broker = Mosquitto(tmp_path, persistence=True)
    await broker.start()
    try:
        async with anyio.create_task_group() as tg:
            relay = Relay(broker.port)
            await relay.open(tg)
            async with subscriber(broker.port, AVAIL) as (rec, _):
                async with running_bridge(mqtt_config(f"mqtt://{HOST}:{relay.port}")) as (bridge, store, _app):
                    await rec.wait_for(AVAIL, is_("online"))
                    first = bridge.connections
                    await broker.stop()  # the broker sends our will as it shuts down and saves it
                    relay.close()  # keep the bridge away until the test has looked
                    await broker.start()
                    async with subscriber(broker.port, "homeassistant/#", "genie/#") as (after, _):
                        assert await after.wait_for(AVAIL) == b"offline"
                        store.publish(TelemetrySample("simulated", temps_c={"cpu": 45.0, "gpu": 66.0}))
                        mark = after.mark()
                        await relay.open(tg)
                        with anyio.fail_after(5):  # within a few seconds of the broker's return
                            await after.wait_for(AVAIL, is_("online"), start=mark)
                        assert bridge.connections == first + 1
                        check_device_message(
                            json.loads(await after.wait_for(T.device_config, start=mark)),
                            availability=AVAIL,
                            expire_s=6,
                        )
                        await after.wait_for(T.state("platform/gpu_temperature"), is_("66"), start=mark)
            tg.cancel_scope.cancel()
    finally:
        await broker.stop()


@needs_broker
@pytest.mark.timeout(30)
async def test_daemon_starts_without_a_broker_and_connects_when_it_appears(tmp_path: Path) -> None:
    """With no broker, run() reports started after startup_wait_s and connects once the broker is up."""
    broker = Mosquitto(tmp_path)
    try:
        with anyio.fail_after(6):
            async with running_bridge(mqtt_config(broker.url, startup_wait_s=0.5)) as (bridge, _s, _a):
                assert not bridge.connected and bridge.last_error
                await broker.start()
                async with subscriber(broker.port, AVAIL) as (rec, _):
                    await rec.wait_for(AVAIL, is_("online"), within_s=2.5)
    finally:
        await broker.stop()


@pytest.mark.timeout(10)
def test_plan_and_start_to_ready_sensors_carry_the_engine_stats() -> None:
    """The scratch, KV shape and start-to-ready sensors publish what the engine stats say."""
    store = StateStore()
    store.publish(
        EngineStats("idle", model="q", kv_mb=612.0, scratch_mb=153.62, n_ctx=8192, kv_dtype="int8", ready_s=1.234)
    )
    by_key = {e.key: e for e in entities(Inputs(store.snapshot()))}
    inputs = Inputs(store.snapshot())
    assert by_key["scratch_memory"].render(inputs) == "153.6"
    assert by_key["start_to_ready"].render(inputs) == "1.23"
    assert json.loads(by_key["kv_memory"].render_attributes(inputs) or "{}") == {"n_ctx": 8192, "kv_dtype": "int8"}
