"""The voice reply never waits for the gate: a voice-class request passes the pauses that protect
the voice path (STT active, its hold-off, TTS), background work stays parked, thermal still holds
everyone; and a voice event pauses the gate in the same loop turn it is published."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
from anyio.abc import TaskGroup

from genie_supervisor.app import Supervisor
from genie_supervisor.arbiter import Arbiter, DecodeGate
from genie_supervisor.events import TelemetrySample, VoiceActivity
from genie_supervisor.policy.evaluate import evaluate
from genie_supervisor.policy.schema import Policy, builtin_policy
from genie_supervisor.state import StateStore
from genie_supervisor.telemetry import SimulatedSource
from genie_supervisor.watchers.wyoming_proxy import WyomingProxy
from tests.awaitlog import Arrivals, Log
from tests.daemon import client, make_supervisor, wait_for, write_policy
from tests.models import SMOLLM2
from tests.test_wyoming_proxy import HOST, client_exchange, free_port, stt_request

pytestmark = pytest.mark.timeout(180)

HI: list[Any] = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
HOLDOFF_MS = 60_000
"""A hold-off that does not end by itself within a test: the test ends it by reloading a policy without one."""
ORDER = itertools.count()
"""Stamps the content pieces of every stream in the order they arrive (no wall clock)."""


def oai(sup: Supervisor) -> openai.AsyncOpenAI:
    """The official client against the daemon (no retries)."""
    assert sup.http is not None
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sup.http.port}/v1", api_key="x", max_retries=0, timeout=60)


@asynccontextmanager
async def _daemon(
    tmp_path: Path, policy: Path, model_loader: Any, source: SimulatedSource | None = None
) -> AsyncIterator[tuple[Supervisor, httpx.AsyncClient, openai.AsyncOpenAI, TaskGroup]]:
    """The daemon on SmolLM2 under `policy`, an HTTP and an openai client to it, and a task group for streams."""
    async with (
        make_supervisor(tmp_path, policy=policy, model=SMOLLM2, model_loader=model_loader, source=source) as sup,
        client(sup) as http,
        oai(sup) as oa,
        anyio.create_task_group() as tg,
    ):
        yield sup, http, oa, tg


def _tokens(sup: Supervisor) -> int:
    """Tokens the engine produced so far, counted now (not the last published stats)."""
    (model,) = sup.engine.models.values()
    return int(model.backend.host.stats().tokens_total)  # type: ignore[attr-defined]


class Stream:
    """One streaming chat request; records, per content piece, its place in `ORDER` and the gate's mode then."""

    def __init__(self, sup: Supervisor, oa: openai.AsyncOpenAI, priority: str, max_tokens: int) -> None:
        self.sup, self.oa, self.priority, self.max_tokens = sup, oa, priority, max_tokens
        self.pieces = Arrivals()
        """(place in ORDER, gate mode) per content piece."""
        self.done = self.pieces.done

    async def run(self) -> None:
        stream = await self.oa.chat.completions.create(
            model="",
            messages=HI,
            max_tokens=self.max_tokens,
            temperature=0,
            stream=True,
            extra_headers={"X-Genie-Priority": self.priority},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if any(c.delta.content for c in chunk.choices):
                self.pieces.add((next(ORDER), self.sup.gate.mode))
        self.pieces.finish()

    async def wait_pieces(self, n: int) -> None:
        await self.pieces.wait_len(n)


async def test_voice_reply_passes_stt_pause_and_holdoff_while_background_stays_parked(
    tmp_path: Path, model_loader: Any
) -> None:
    """While STT is active and during its hold-off, a voice request streams to its end through the pause; the parked background generation yields it the model without taking a step and gets no token until the pause ends."""
    policy = write_policy(tmp_path / "p.yaml", holdoff_ms=HOLDOFF_MS)
    async with _daemon(tmp_path, policy, model_loader) as (sup, http, oa, tg):
        with anyio.fail_after(150):
            bg = Stream(sup, oa, "background", 400)
            tg.start_soon(bg.run)
            await bg.wait_pieces(2)
            assert (await http.post("/v1/voice/events", json={"service": "stt", "event": "start"})).status_code == 200
            assert sup.gate.mode == "paused" and sup.gate.reasons == {"stt"}
            assert sup.gate.metrics()["voice_mode"] == "open"
            assert await sup.gate.wait_parked(30)
            parked_tokens = _tokens(sup)  # the engine's count: no piece in transit

            during_stt = Stream(sup, oa, "voice", 4)
            await during_stt.run()  # STT still active: it streams through the pause
            assert len(during_stt.pieces) == 4 and {m for _, m in during_stt.pieces} == {"paused"}

            await http.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
            assert sup.gate.mode == "paused"  # the hold-off
            during_holdoff = Stream(sup, oa, "voice", 4)
            await during_holdoff.run()
            assert {m for _, m in during_holdoff.pieces} == {"paused"}
            assert sup.gate.mode == "paused", "the voice reply waited for the hold-off"  # it is still running
            assert _tokens(sup) == parked_tokens + 8, "background decoded while paused"
            assert sup.gate.metrics()["passed_steps_total"] >= 8

            resumed = len(bg.pieces)  # parked until the hold-off ends: end it now
            write_policy(policy, holdoff_ms=0)
            assert await sup.reload_policy() is True
            await wait_for(sup, lambda: sup.gate.mode == "open")
            await bg.wait_pieces(resumed + 1)
            assert bg.pieces[resumed][1] == "open"
            tg.cancel_scope.cancel()


async def test_thermal_pause_holds_the_voice_request_too(tmp_path: Path, model_loader: Any) -> None:
    """A thermal pause parks a voice request before its first token, also while STT is active; it answers once the box cools."""
    source = SimulatedSource(temps_c={"cpu": 50.0})
    policy = write_policy(tmp_path / "p.yaml", holdoff_ms=0)
    async with _daemon(tmp_path, policy, model_loader, source) as (sup, http, oa, tg):
        with anyio.fail_after(120):
            source.set(temps_c={"cpu": 99.0})
            await wait_for(sup, lambda: sup.gate.reasons == {"thermal"})
            await http.post("/v1/voice/events", json={"service": "stt", "event": "start"})
            assert sup.gate.reasons == {"stt", "thermal"} and sup.gate.metrics()["voice_mode"] == "paused"
            voice = Stream(sup, oa, "voice", 3)
            tg.start_soon(voice.run)
            await wait_for(sup, lambda: sup.gate.metrics()["parked_generations"] == 1)
            assert sup.gate.parked and voice.pieces == []
            await http.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
            for _ in range(3):  # a few telemetry samples later, still hot: still parked
                await sup.store.wait_changed(sup.store.version)
            assert voice.pieces == [] and sup.gate.metrics()["parked_generations"] == 1
            source.set(temps_c={"cpu": 50.0})
            await voice.done.wait()
            assert len(voice.pieces) == 3 and voice.pieces[0][1] == "open"


async def test_voice_goes_first_when_both_are_eligible_and_background_resumes_after(
    tmp_path: Path, model_loader: Any
) -> None:
    """With the gate open, a voice request preempts a running background stream (issue 6): it ends before the background one takes another step."""
    policy = write_policy(tmp_path / "p.yaml", holdoff_ms=0)
    async with _daemon(tmp_path, policy, model_loader) as (sup, _http, oa, tg):
        with anyio.fail_after(120):
            bg = Stream(sup, oa, "background", 30)
            tg.start_soon(bg.run)
            await bg.wait_pieces(2)
            voice = Stream(sup, oa, "voice", 4)
            sent = next(ORDER)
            await voice.run()
            assert not bg.done.is_set()
            during = [t for t, _ in bg.pieces if sent < t < voice.pieces[-1][0]]
            assert len(during) <= 2  # the step running when it came (and its piece in transit)
            await bg.done.wait()
            assert len(bg.pieces) == 30


# -- the policy's part (pure) ------------------------------------------------------------------


def _policy(tts: dict[str, Any]) -> Policy:
    return Policy.model_validate(
        {
            "version": 1,
            "name": "t",
            "voice": {"stt": {"action": "pause", "resume_holdoff_ms": 300}, "tts": tts},
            "thermal": {
                "sensor": "cpu",
                "levels": [
                    {"name": "warm", "enter_c": 80, "leave_c": 70, "action": "throttle", "throttle_tps": 10},
                    {"name": "hot", "enter_c": 95, "leave_c": 90, "action": "pause"},
                ],
            },
        }
    )


def _decide(policy: Policy, *obs: Any) -> Any:
    store = StateStore()
    for o in obs:
        store.publish(o)
    return evaluate(policy, store.snapshot())


def test_policy_gives_the_voice_class_its_own_mode() -> None:
    """STT, its hold-off and TTS do not hold the voice class; thermal pauses and throttles do."""
    p = _policy({"action": "throttle", "throttle_tps": 4})
    stt = VoiceActivity("stt", True, "test")
    d = _decide(p, stt)
    assert (d.gate, d.voice_gate, d.voice_passes) == ("paused", "open", {"stt"})
    d = _decide(p, stt, VoiceActivity("stt", False, "test"))
    assert d.gate == "paused" and d.voice_gate == "open" and d.fired[0].rule == "voice.stt.resume_holdoff_ms"
    d = _decide(p, VoiceActivity("tts", True, "test"))
    assert (d.gate, d.throttle_tps, d.voice_gate) == ("throttled", 4, "open")
    warm = TelemetrySample(platform="simulated", temps_c={"cpu": 85.0})
    d = _decide(p, warm, VoiceActivity("tts", True, "test"))
    assert (d.gate, d.throttle_tps, d.voice_gate, d.voice_throttle_tps) == ("throttled", 4, "throttled", 10)
    d = _decide(p, warm, stt)
    assert (d.gate, d.voice_gate, d.voice_throttle_tps) == ("paused", "throttled", 10)
    d = _decide(p, TelemetrySample(platform="simulated", temps_c={"cpu": 99.0}), stt)
    assert (d.gate, d.pause_reasons, d.voice_gate) == ("paused", {"stt", "thermal"}, "paused")
    assert "voice=" not in d.action_text() and "voice=open" in _decide(p, stt).action_text()


# -- the reaction path: no loop turn between a voice event and the pause ----------------------


async def test_published_voice_event_pauses_the_gate_before_publish_returns() -> None:
    """The arbiter decides inside StateStore.publish: the gate is paused when publish returns, with no await in between."""
    store, gate = StateStore(), DecodeGate()
    arbiter = Arbiter(gate)
    policy = builtin_policy()
    async with anyio.create_task_group() as tg:
        await tg.start(arbiter.run, store, lambda: policy)
        assert gate.mode == "open"
        store.publish(VoiceActivity("stt", True, "test", session="a"))
        assert gate.mode == "paused" and gate.reasons == {"stt"}  # same loop turn
        store.publish(VoiceActivity("stt", False, "test", session="a"))
        assert gate.mode == "paused"  # the hold-off (300 ms): the arbiter's timer opens it
        with anyio.fail_after(5):
            await gate.wait("decode")  # returns once the gate is open
        assert gate.mode == "open"
        tg.cancel_scope.cancel()


async def test_proxy_pauses_the_gate_before_it_connects_upstream() -> None:
    """The proxy publishes the STT start before it connects upstream: the gate pauses even when the connect then fails."""
    store, gate = StateStore(), DecodeGate()
    arbiter = Arbiter(gate)
    policy = builtin_policy()
    published = Log()

    def publish(obs: Any) -> None:
        published(obs)
        store.publish(obs)

    proxy = WyomingProxy("whisper", HOST, 0, HOST, free_port(), "stt", publish, health_interval_s=None)
    async with anyio.create_task_group() as tg:
        await tg.start(arbiter.run, store, lambda: policy)
        await tg.start(proxy.serve)
        assert proxy.port is not None
        assert await client_exchange(proxy.port, stt_request(1)) == []  # nothing listens upstream
        await published.wait_for(lambda o: isinstance(o, VoiceActivity) and not o.active)
        tg.cancel_scope.cancel()
    voice = [(o.active, o.event) for o in published.items if isinstance(o, VoiceActivity)]
    assert voice == [(True, "transcribe"), (False, "close")]
    assert gate.metrics()["pauses_total"] == {"stt": 1}
