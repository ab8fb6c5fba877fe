"""Home Assistant's rough edges over a real Mosquitto: command bursts coalesce, bad payloads never
drop the connection, every enum value is an option, refusals are published and controls snap back,
availability expires (heartbeat, expire_after, a keepalive short enough for the will)."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genie_supervisor.app import Supervisor
from genie_supervisor.config import MqttConfig
from genie_supervisor.events import EngineStats
from genie_supervisor.mqtt.commands import (
    COMMAND_PATHS,
    Command,
    CommandError,
    PendingCommands,
    parse_command,
)
from genie_supervisor.mqtt.discovery import device_config
from genie_supervisor.mqtt.entities import CommandRefusal, Inputs, entities
from genie_supervisor.state import GateMode, StateStore
from genie_supervisor.telemetry import SimulatedSource
from tests.apitools import synth
from tests.broker import Mosquitto, needs_broker
from tests.daemon import TINY_ENGINE, make_supervisor, write_policy
from tests.net import HOST
from tests.test_mqtt import (
    AVAIL,
    INFO,
    TOPICS,
    FakeApp,
    T,
    check_device_message,
    is_,
    mqtt_config,
    online_bridge,
    running_bridge,
    sample_inputs,
    subscriber,
)

ENGINE_STATES = ("disabled", "unloaded", "loading", "error", "idle", "prefill", "decoding", "paused", "throttled")
"""Every state EngineHost.state and ModelManager.stats() report (engine_host.py, models.py)."""


# -- pure parts ---------------------------------------------------------------------------------
def test_pending_commands_keep_first_arrival_order_and_the_latest_value() -> None:
    """A newer command on a waiting topic replaces it in place; topics run in the order they first waited."""
    pending = PendingCommands()
    assert not pending.put("llm/enabled/set", Command("set_llm_enabled", False))
    assert not pending.put("thermal/soft_limit/set", Command("set_thermal_soft_limit", 60.0))
    for n in range(200):
        pending.put("llm/enabled/set", Command("set_llm_enabled", n % 2 == 1))
    assert pending.put("thermal/soft_limit/set", Command("set_thermal_soft_limit", 70.0))
    assert len(pending) == 2

    async def drain() -> list[Command]:
        return [await pending.get(), await pending.get()]

    got = anyio.run(drain)
    assert [(c.action, c.arg) for c in got] == [("set_llm_enabled", True), ("set_thermal_soft_limit", 70.0)]
    assert len(pending) == 0


def test_every_enum_sensor_lists_every_value_it_can_publish() -> None:
    """llm_state (all engine states, unloaded included, and disabled by the switch) and gate_mode are always options."""

    def options(inputs: Inputs) -> dict[str, list[str]]:
        return {e.key: list(e.extra["ops"]) for e in entities(inputs) if e.device_class == "enum"}

    assert set(options(sample_inputs())) == {"llm_state", "gate_mode"}
    seen: dict[str, set[str]] = {"llm_state": set(), "gate_mode": set()}
    for state, mode, enabled in itertools.product(ENGINE_STATES, typing.get_args(GateMode), (True, False, None)):
        store = StateStore()
        store.publish(EngineStats(state, model="smollm2"))
        inputs = Inputs(store.snapshot(), {"mode": mode}, llm_enabled=enabled)
        ops = options(inputs)
        for e in entities(inputs):
            if e.key in ops:
                value = e.render(inputs)
                assert value in ops[e.key], f"{e.key} publishes {value!r}, not in its options {ops[e.key]}"
                seen[e.key].add(str(value))
    assert "unloaded" in seen["llm_state"] and "disabled" in seen["llm_state"]
    assert seen["gate_mode"] == set(typing.get_args(GateMode))


@pytest.mark.parametrize(
    ("state", "model", "shown"),
    [
        ("unloaded", "tiny.gguf", "none"),
        ("disabled", None, "none"),
        ("idle", "smollm2", "smollm2"),
        ("loading", "smollm2", "smollm2"),
        ("idle", None, "none"),
    ],
)
def test_model_sensor_reads_none_without_a_loaded_model(state: str, model: str | None, shown: str) -> None:
    """After an unload the model sensor says `none` (as docs/mqtt.md says), not the file name."""
    store = StateStore()
    store.publish(EngineStats(state, model=model))
    inputs = Inputs(store.snapshot())
    [sensor] = [e for e in entities(inputs) if e.key == "model"]
    assert sensor.render(inputs) == shown


@pytest.mark.parametrize("press", [b"PRESS", b"press", b"Press", b" press\n"])
def test_buttons_accept_press_in_any_case(press: bytes) -> None:
    """Buttons take PRESS case-insensitively (docs/mqtt.md); anything else is refused."""
    for path in ("policy/reload", "llm/unload"):
        assert parse_command(path, T.state(path), press, sample_inputs()).action == COMMAND_PATHS[path]
        with pytest.raises(CommandError):
            parse_command(path, T.state(path), press + b"ed", sample_inputs())


def test_discovery_gives_every_entity_an_availability_and_sensors_an_expiry() -> None:
    """Every component names the availability topic (kept by heartbeat and will); sensors expire after 3 refreshes."""
    cfg = MqttConfig(url="mqtt://127.0.0.1")
    assert cfg.keepalive * 1.5 <= 15, "the broker fires the will 1.5 x keepalive after the daemon goes silent"
    ents = entities(sample_inputs(command_error=CommandRefusal("t", "p", "why", "2026-01-01T00:00:00Z")))
    cmps = check_device_message(
        json.loads(json.dumps(device_config(ents, TOPICS, INFO, expire_s=15))), availability=AVAIL, expire_s=15
    )
    assert all(c["availability_topic"] == AVAIL for c in cmps.values())
    expiring = {k for k, c in cmps.items() if "expire_after" in c}
    assert expiring == {k for k, c in cmps.items() if c["platform"] in ("sensor", "binary_sensor")}
    err = cmps["command_error"]
    assert err["platform"] == "sensor" and err["json_attributes_topic"] == T.state("command/last_error/attributes")


# -- over the broker ----------------------------------------------------------------------------
def has(part: bytes) -> Callable[[bytes], bool]:
    """Predicate: the payload contains `part`."""
    return lambda p: part in p


class SlowApp(FakeApp):
    """The first LLM switch command waits for `generation_done` (as a switch that waits behind a generation)."""

    def __init__(self, store: StateStore) -> None:
        super().__init__(store)
        self.generation_done = anyio.Event()
        self.switch_started = anyio.Event()

    async def set_llm_enabled(self, on: bool) -> None:
        if not self.switch_started.is_set():
            self.switch_started.set()
            await self.generation_done.wait()
        await super().set_llm_enabled(on)


@needs_broker
@pytest.mark.timeout(30)
async def test_a_burst_of_200_toggles_ends_in_the_last_value(broker: Mosquitto) -> None:
    """200 OFF/ON toggles ending in ON while the first one is busy: nothing is dropped, the LLM ends ON."""
    async with online_bridge(broker, make_app=SlowApp) as (rec, client, _bridge, _store, app):
        assert isinstance(app, SlowApp)
        for n in range(200):
            await client.publish(T.state("llm/enabled/set"), "OFF" if n % 2 == 0 else "ON", qos=1)
        # voice hints are handled as they arrive: once this one is, every toggle before it was received
        await client.publish(T.voice_events, json.dumps({"service": "stt", "event": "start"}), qos=1)
        assert await app.wait_calls(1) == [("voice_hint", {"service": "stt", "event": "start"})]
        assert app.switch_started.is_set()
        app.generation_done.set()
        await client.publish(T.state("policy/reload"), "PRESS", qos=1)  # runs after every waiting toggle
        calls = await app.wait_calls(4)
        assert calls[1:] == [("set_llm_enabled", False), ("set_llm_enabled", True), ("reload_policy", None)]
        assert app.enabled
        mark = rec.mark()  # the refresh (every 2 s here) re-sends every state: what HA reads now
        assert await rec.wait_for(T.state("llm/enabled"), start=mark, within_s=4) == b"ON"


@needs_broker
@pytest.mark.timeout(30)
async def test_deep_json_on_voice_events_keeps_the_connection(broker: Mosquitto) -> None:
    """A voice hint nested thousands deep (or too long) is refused; the connection stays and the next hint works."""
    async with online_bridge(broker) as (rec, client, bridge, store, app):
        first = bridge.connections
        mark = rec.mark()
        await client.publish(T.voice_events, b"[" * 4000, qos=1)
        await rec.wait_for(T.state("command/last_error"), lambda p: b"nested deeper" in p, start=mark)
        await client.publish(T.voice_events, b"[" * 100_000, qos=1)
        await rec.wait_for(T.state("command/last_error"), lambda p: b"at most" in p, start=mark)
        await client.publish(T.voice_events, json.dumps({"service": "stt", "event": "start"}), qos=1)
        assert await app.wait_calls(1) == [("voice_hint", {"service": "stt", "event": "start"})]
        assert store.snapshot().voice.stt_active
        assert bridge.connected and bridge.connections == first


@needs_broker
@pytest.mark.timeout(30)
async def test_a_refused_command_is_published_and_the_control_snaps_back(broker: Mosquitto) -> None:
    """An out-of-range number and a value the app refuses each show on command_error; the old value is re-sent."""

    class Picky(FakeApp):
        async def set_thermal_soft_limit(self, c: float) -> None:
            if c > 100:
                raise ValueError(f"{c:g} °C would reach the hot level")
            await super().set_thermal_soft_limit(c)

    async with online_bridge(broker, make_app=Picky) as (rec, client, bridge, _store, app):
        limit, err = T.state("thermal/soft_limit"), T.state("command/last_error")
        await rec.wait_for(limit, is_("80"))
        await rec.wait_for(err, is_("none"))
        for payload, reason in (("200", b"must be 40-105"), ("104", b"would reach the hot level")):
            mark = rec.mark()
            await client.publish(T.state("thermal/soft_limit/set"), payload, qos=1)
            await rec.wait_for(err, has(reason), start=mark)
            attrs = json.loads(
                await rec.wait_for(T.state("command/last_error/attributes"), has(payload.encode()), start=mark)
            )
            assert attrs["topic"] == T.state("thermal/soft_limit/set") and attrs["payload"] == payload
            assert reason.decode() in attrs["reason"] and attrs["time"].endswith("Z")
            assert await rec.wait_for(limit, start=mark) == b"80"  # sent again though unchanged
        assert app.limit == 80.0 and app.calls == []
        assert bridge.status()["last_command_error"]["payload"] == "104"


@needs_broker
@pytest.mark.timeout(30)
async def test_availability_is_refreshed_as_a_heartbeat(broker: Mosquitto) -> None:
    """`online` is published again with every periodic refresh, not only once per connection."""
    async with subscriber(broker.port, AVAIL) as (rec, _):
        async with running_bridge(mqtt_config(broker.url, publish_interval_s=0.5)):
            await rec.wait_for(AVAIL, is_("online"))
            for _ in range(2):
                await rec.wait_for(AVAIL, is_("online"), start=rec.mark(), within_s=3)


FROZEN_BRIDGE = """
import sys, anyio
from genie_supervisor.config import MqttConfig
from genie_supervisor.mqtt import MqttBridge, MqttCommands
from genie_supervisor.state import GateMode, StateStore

async def nothing(*args):
    pass

async def main():
    cfg = MqttConfig(url=sys.argv[1], keepalive=5, publish_interval_s=1)
    commands = MqttCommands(select_policy=nothing, set_llm_enabled=nothing, reload_policy=nothing,
                            unload_model=nothing, set_thermal_soft_limit=nothing, voice_hint=nothing,
                            policy_options=lambda: [])
    await MqttBridge(cfg, "testbox", StateStore(), gate_metrics=dict, commands=commands).run()

anyio.run(main)
"""


@needs_broker
@pytest.mark.timeout(40)
async def test_a_frozen_daemon_goes_offline_by_its_will(broker: Mosquitto, tmp_path: Path) -> None:
    """A bridge process stopped dead (SIGSTOP) is shown `offline` by the broker within 1.5 x keepalive."""
    script = tmp_path / "bridge.py"
    script.write_text(FROZEN_BRIDGE)
    async with subscriber(broker.port, AVAIL) as (rec, _):
        proc = await anyio.open_process(
            [sys.executable, str(script), broker.url],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=Path(__file__).parent.parent,
        )
        try:
            await rec.wait_for(AVAIL, is_("online"), within_s=20)
            proc.send_signal(signal.SIGSTOP)
            mark = rec.mark()
            # 1.5 x keepalive after the last packet, plus Mosquitto's keepalive sweep and delivery
            # (measured 8.5-9.5 s for keepalive 5 on an idle 2-core machine)
            with anyio.fail_after(5 * 1.5 + 5):
                await rec.wait_for(AVAIL, is_("offline"), start=mark, within_s=30)
        finally:
            proc.kill()
            await proc.wait()


# -- generated bad input --------------------------------------------------------------------------
_json = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
PAYLOADS = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=32).map(str.encode),
    st.sampled_from(
        [
            "",
            "ON",
            "off",
            "PRESS",
            "press",
            "nan",
            "inf",
            "-inf",
            "1e400",
            "-0",
            " 72.5 ",
            "104",
            "default",
            "orin-nano-8gb",
            "null",
            "{}",
            "[]",
            '{"service": "stt"}',
            "\x00",
            "\ud7ff",
        ]
    ).map(lambda s: s.encode()),
    _json.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {
            "service": st.sampled_from(["stt", "tts", "x"]),
            "event": st.sampled_from(["start", "stop", 1]),
            "session": _json,
        }
    ).map(lambda v: json.dumps(v).encode()),
    st.integers(1, 6000).map(lambda n: b"[" * n),
    st.integers(1, 2000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.integers(4000, 20_000).map(lambda n: b"7" * n),
)


@needs_broker
@pytest.mark.timeout(120)
def test_generated_garbage_on_every_command_topic_never_drops_the_connection(tmp_path: Path) -> None:
    """Generated payloads on every command topic never end the connection; a valid command after each one works."""
    limits = itertools.cycle([50.0 + n / 2 for n in range(60)])
    with anyio.from_thread.start_blocking_portal() as portal:
        mosquitto = Mosquitto(tmp_path)
        portal.call(mosquitto.start)
        try:
            with (
                portal.wrap_async_context_manager(running_bridge(mqtt_config(mosquitto.url))) as (bridge, _s, app),
                portal.wrap_async_context_manager(subscriber(mosquitto.port, AVAIL)) as (rec, client),
            ):
                portal.call(rec.wait_for, AVAIL, is_("online"))
                first = bridge.connections

                async def garbage_then_valid(path: str, payload: bytes, limit: float) -> None:
                    await client.publish(T.state(path), payload, qos=1)
                    await client.publish(T.state("thermal/soft_limit/set"), f"{limit:g}", qos=1)
                    with anyio.fail_after(5):
                        while app.limit != limit:
                            await app.changed.wait()

                @settings(
                    max_examples=100,
                    derandomize=True,
                    deadline=None,
                    database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                )
                @given(path=st.sampled_from(sorted(COMMAND_PATHS)), payload=PAYLOADS)
                def check(path: str, payload: bytes) -> None:
                    portal.call(garbage_then_valid, path, payload, next(limits))
                    assert bridge.connected and bridge.connections == first

                check()
        finally:
            portal.call(mosquitto.stop)


# -- the daemon ---------------------------------------------------------------------------------
def _supervisor(tmp_path: Path, broker_url: str) -> Supervisor:
    """The daemon on the tiny model with MQTT on `broker_url`."""
    return make_supervisor(
        tmp_path,
        policy=write_policy(tmp_path / "alpha.yaml", "alpha"),
        source=SimulatedSource(temps_c={"cpu": 50.0}),
        engine=TINY_ENGINE,
        extra=f"models: {{tiny: {{path: {synth(tmp_path, 'tiny')}}}}}\nmqtt: {{url: '{broker_url}', publish_interval_s: 5}}",
    )


@needs_broker
@pytest.mark.timeout(90)
async def test_daemon_status_shows_mqtt_without_secrets_and_unload_reads_unloaded_and_none(
    broker: Mosquitto, tmp_path: Path
) -> None:
    """/status says MQTT is connected (broker without the URL's password); Unload makes llm/state
    `unloaded` (one of its options) and the model sensor `none`."""
    base = "genie/genie"
    url = f"mqtt://genie:s3cr3t-pw@{HOST}:{broker.port}"  # an anonymous broker takes any credentials
    async with subscriber(broker.port, "genie/#", "homeassistant/#") as (rec, client):
        async with _supervisor(tmp_path, url) as sup:
            assert sup.http is not None
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sup.http.port}", timeout=30) as api:
                await rec.wait_for(f"{base}/availability", is_("online"), within_s=10)
                r = await api.get("/status")
                assert "s3cr3t" not in r.text
                mqtt: dict[str, Any] = r.json()["mqtt"]
                assert mqtt["connected"] is True and mqtt["broker"] == broker.url and mqtt["since"]
                assert mqtt["url"] == f"mqtt://***@{HOST}:{broker.port}" and mqtt["last_error"] is None

                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                assert (await api.post("/v1/chat/completions", json=body)).status_code == 200
                await rec.wait_for(f"{base}/llm/model", is_("tiny"), within_s=10)
                cfg = json.loads(await rec.wait_for("homeassistant/device/genie/config"))
                assert "unloaded" in cfg["cmps"]["llm_state"]["ops"]
                await client.publish(f"{base}/llm/unload", "press", qos=1)  # lowercase, as docs allow
                await rec.wait_for(f"{base}/llm/state", is_("unloaded"), within_s=10)
                await rec.wait_for(f"{base}/llm/model", is_("none"), within_s=5)
