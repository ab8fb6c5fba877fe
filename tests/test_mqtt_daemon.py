"""The daemon's Home Assistant controls over a real Mosquitto: policy select, LLM switch, soft limit."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from genie_supervisor.app import Supervisor
from genie_supervisor.telemetry import SimulatedSource
from tests.apitools import synth
from tests.broker import Mosquitto, needs_broker
from tests.daemon import TINY_ENGINE, make_supervisor, write_policy
from tests.test_mqtt import is_, subscriber

pytestmark = [needs_broker, pytest.mark.timeout(90)]
BASE = "genie/genie"


def _supervisor(tmp_path: Path, broker_url: str, source: SimulatedSource) -> Supervisor:
    policies = tmp_path / "policies"
    policies.mkdir()
    write_policy(policies / "alpha.yaml", "alpha")
    write_policy(policies / "beta.yaml", "beta")
    (policies / "broken.yaml").write_text("version: 1\nname: broken\nvoice: {stt: {action: explode}}\n")
    return make_supervisor(
        tmp_path,
        policy=policies / "alpha.yaml",
        model=synth(tmp_path, "tiny"),
        source=source,
        engine=TINY_ENGINE,
        extra=f"mqtt: {{url: '{broker_url}', publish_interval_s: 5}}",
    )


async def test_select_switch_and_soft_limit_act_on_the_daemon(tmp_path: Path) -> None:
    """The select switches policy, the switch gives 503 while off, the number moves the thermal level,
    and malformed or rejected commands change nothing."""
    broker = Mosquitto(tmp_path)
    await broker.start()
    source = SimulatedSource(temps_c={"cpu": 50.0})
    try:
        async with subscriber(broker.port, f"{BASE}/#") as (rec, client):
            async with _supervisor(tmp_path, broker.url, source) as sup:
                import httpx

                assert sup.http is not None
                api = httpx.AsyncClient(base_url=f"http://127.0.0.1:{sup.http.port}", timeout=30)
                await rec.wait_for(f"{BASE}/availability", is_("online"), within_s=10)
                await rec.wait_for(f"{BASE}/policy/selected", is_("alpha"))

                # a bad option and a file that fails validation change nothing
                for bad in ("nope", "broken"):
                    await client.publish(f"{BASE}/policy/set", bad, qos=1)
                await client.publish(f"{BASE}/policy/set", "beta", qos=1)
                await rec.wait_for(f"{BASE}/policy/name", is_("beta"))
                assert sup.policy.name == "beta"
                assert (await api.get("/status")).json()["policy"]["name"] == "beta"

                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                await client.publish(f"{BASE}/llm/enabled/set", "OFF", qos=1)
                await rec.wait_for(f"{BASE}/llm/enabled", is_("OFF"))
                r = await api.post("/v1/chat/completions", json=body)
                assert r.status_code == 503 and "disabled" in r.text
                await client.publish(f"{BASE}/llm/enabled/set", "ON", qos=1)
                await rec.wait_for(f"{BASE}/llm/enabled", is_("ON"))
                with anyio.fail_after(30):
                    while (r := await api.post("/v1/chat/completions", json=body)).status_code == 503:
                        await sup.store.wait_changed(sup.store.version)
                assert r.status_code == 200

                # soft limit 60 °C: the first level (warm: 80/70) now enters at 60 and leaves at 50
                await client.publish(f"{BASE}/thermal/soft_limit/set", "60", qos=1)
                await rec.wait_for(f"{BASE}/thermal/soft_limit", lambda p: float(p) == 60.0)
                assert [lv.enter_c for lv in sup.policy.thermal.levels] == [60.0, 95.0]
                source.set(temps_c={"cpu": 65.0})
                with anyio.fail_after(10):
                    while (
                        sup.store.snapshot().decision is None or sup.store.snapshot().decision.thermal_level != "warm"
                    ):
                        await sup.store.wait_changed(sup.store.version)
                # a limit at the hot level's enter temperature would break the ordering: refused
                mark = rec.mark()
                await client.publish(f"{BASE}/thermal/soft_limit/set", "95", qos=1)
                await client.publish(f"{BASE}/llm/enabled/set", "OFF", qos=1)  # runs after the refused one
                await rec.wait_for(f"{BASE}/llm/enabled", is_("OFF"), start=mark)
                assert sup.policy.thermal.levels[0].enter_c == 60.0
                await api.aclose()
    finally:
        await broker.stop()


async def test_a_burst_of_toggles_during_a_generation_ends_in_the_last_value(tmp_path: Path) -> None:
    """200 OFF/ON toggles of the LLM switch, ending in ON, while OFF waits for a generation to drain:
    none is dropped, the LLM ends ON and serves the next request."""
    import json

    import httpx

    broker = Mosquitto(tmp_path)
    await broker.start()
    try:
        async with subscriber(broker.port, f"{BASE}/#") as (rec, client):
            async with (
                _supervisor(tmp_path, broker.url, SimulatedSource(temps_c={"cpu": 50.0})) as sup,
                anyio.create_task_group() as tg,
            ):
                assert sup.http is not None
                api = httpx.AsyncClient(base_url=f"http://127.0.0.1:{sup.http.port}", timeout=60)
                await rec.wait_for(f"{BASE}/availability", is_("online"), within_s=10)
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
                # STT pauses decoding (the policy), so the generation stays in flight until STT stops
                assert (await api.post("/v1/voice/events", json={"service": "stt", "event": "start"})).status_code < 300
                done = anyio.Event()

                async def generate() -> None:
                    r = await api.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    done.set()

                tg.start_soon(generate)
                with anyio.fail_after(20):
                    while sup.store.snapshot().engine is None or sup.store.snapshot().engine.requests_in_flight == 0:
                        await sup.store.wait_changed(sup.store.version)
                for n in range(200):
                    await client.publish(f"{BASE}/llm/enabled/set", "OFF" if n % 2 == 0 else "ON", qos=1)
                # handled as it arrives: once TTS shows active, every toggle before it was received
                await client.publish(f"{BASE}/voice/events", json.dumps({"service": "tts", "event": "start"}), qos=1)
                with anyio.fail_after(10):
                    while not sup.store.snapshot().voice.tts_active:
                        await sup.store.wait_changed(sup.store.version)
                assert not done.is_set() and sup.models.enabled is False  # OFF runs, waiting for the drain
                assert (await api.post("/v1/voice/events", json={"service": "stt", "event": "stop"})).status_code < 300
                with anyio.fail_after(30):
                    await done.wait()
                    while not sup.models.enabled:
                        await sup.store.wait_changed(sup.store.version)
                await rec.wait_for(f"{BASE}/llm/enabled", is_("ON"), start=rec.mark(), within_s=8)
                assert sup.models.enabled
                with anyio.fail_after(30):
                    while (r := await api.post("/v1/chat/completions", json=body)).status_code == 503:
                        await sup.store.wait_changed(sup.store.version)
                assert r.status_code == 200
                await api.aclose()
    finally:
        await broker.stop()
