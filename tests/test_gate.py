"""DecodeGate: pausing parks the engine, throttling paces it, and the Arbiter applies decisions."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest

from engine.gate import Gate
from genie_supervisor.arbiter import Arbiter, DecodeGate
from genie_supervisor.events import TelemetrySample, VoiceActivity
from genie_supervisor.policy.schema import Policy
from genie_supervisor.state import Decision, FiredRule, StateStore
from tests.clock import FakeClock


async def decode_loop(
    gate: DecodeGate,
    steps: list[float],
    n: int,
    started: anyio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    stepped: Callable[[], None] = lambda: None,
) -> None:
    """A fake generation: awaits the gate before each of `n` steps, records step times on `clock` and
    calls `stepped` after each."""
    with gate.generation():
        if started is not None:
            started.set()
        for _ in range(n):
            await gate.wait("decode")
            steps.append(clock())
            stepped()
            await anyio.lowlevel.checkpoint()


def test_gate_implements_engine_protocol() -> None:
    """DecodeGate satisfies the engine's Gate protocol."""
    assert isinstance(DecodeGate(), Gate)


async def test_open_gate_passes() -> None:
    """An open gate returns at once and counts steps."""
    gate = DecodeGate()
    with anyio.fail_after(2):
        await gate.wait("prefill")
        await gate.wait("decode")
    assert gate.metrics()["steps_total"] == {"prefill": 1, "decode": 1}


async def test_pause_parks_and_records_reaction_then_resume_releases() -> None:
    """A paused gate parks the waiter, records reaction time from the cause, and resume releases it."""
    clock = FakeClock()
    gate = DecodeGate(clock)
    started = anyio.Event()
    steps: list[float] = []

    gate.pause({"stt"}, cause_ts=clock() - 0.002)  # the observation came 2 ms before the pause
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(decode_loop, gate, steps, 1, started)
            await started.wait()
            assert await gate.wait_parked(5) is True
            assert gate.parked and steps == []
            m = gate.metrics()
            assert m["mode"] == "paused" and m["reasons"] == ["stt"] and m["parked_generations"] == 1
            assert m["reactions"] == 1 and m["reaction_ms_last"] == pytest.approx(2.0)
            clock.advance(0.5)
            gate.open()
    m = gate.metrics()
    assert len(steps) == 1 and m["pauses_total"] == {"stt": 1} and m["mode"] == "open"
    assert m["paused_seconds"]["stt"] == pytest.approx(0.5)


async def test_wait_parked_without_generation_is_immediate() -> None:
    """With no generation running the gate counts as parked at once."""
    gate = DecodeGate()
    gate.pause({"stt"})
    with anyio.fail_after(1):
        assert await gate.wait_parked(10) is True


async def test_wait_parked_waits_for_running_step() -> None:
    """wait_parked blocks while a generation is between steps and returns once it parks."""
    gate = DecodeGate()
    in_step = anyio.Event()
    finish_step = anyio.Event()

    async def generation() -> None:
        with gate.generation():
            in_step.set()
            await finish_step.wait()  # the forward pass of the current step
            await gate.wait("decode")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(generation)
            await in_step.wait()
            gate.pause({"stt"}, cause_ts=time.monotonic())
            assert await gate.wait_parked(0.01) is False  # still in its step: bounded wait times out
            finish_step.set()
            assert await gate.wait_parked(5) is True
            gate.open()


async def test_wait_parked_returns_when_not_paused() -> None:
    """When the gate is not paused there is nothing to wait for: wait_parked returns at once."""
    gate = DecodeGate()
    with gate.generation(), anyio.fail_after(1):
        assert await gate.wait_parked(10) is False


async def test_throttle_paces_to_cap() -> None:
    """A throttled gate lets one decode step through per 1/cap seconds of its clock: at 200 tok/s, 20 steps
    after the first take exactly 0.1 s of it, and the time it held them back is counted."""
    clock = FakeClock()
    gate = DecodeGate(clock)
    gate.throttle(200)
    steps: list[float] = []
    box = {"stepped": anyio.Event()}

    def stepped() -> None:
        box["stepped"].set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(decode_loop, gate, steps, 21, None, clock, stepped)
            await box["stepped"].wait()  # the first step passes at once
            for k in range(2, 22):
                box["stepped"] = anyio.Event()
                clock.advance(0.5 / 200)
                await anyio.sleep(0.02)  # an observation window: half a slot lets no step through
                assert len(steps) == k - 1
                clock.advance(0.5 / 200)
                await box["stepped"].wait()
                assert len(steps) == k
    assert steps[-1] - steps[0] == pytest.approx(0.1)
    assert 0 < gate.metrics()["throttle_wait_seconds"] <= 0.1 + 1e-9  # the clock time it held steps back


async def test_throttle_does_not_pace_prefill() -> None:
    """Prefill chunks are not paced by a throttle (only a pause stops them)."""
    gate = DecodeGate()
    gate.throttle(1)
    with anyio.fail_after(1):
        for _ in range(5):
            await gate.wait("prefill")


async def test_pause_interrupts_throttle_sleep() -> None:
    """A waiter sleeping for its throttle slot parks at once when the gate pauses."""
    gate = DecodeGate()
    gate.throttle(0.01)  # one step per 100 s
    steps: list[float] = []
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(decode_loop, gate, steps, 2)
            while len(steps) < 1:
                await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            gate.pause({"thermal"}, cause_ts=time.monotonic())
            assert await gate.wait_parked(5)
            gate.open()
    assert len(steps) == 2


def test_blocks_says_whether_wait_would_park_for_each_class() -> None:
    """`blocks` is true exactly while a class's wait would park: never open or throttled, and
    not for the voice class that a voice gate lets through a pause."""
    gate = DecodeGate()
    assert not gate.blocks("prefill")
    gate.throttle(5.0)
    assert not gate.blocks("decode") and not gate.blocks("prefill")
    gate.set_mode("paused", reasons=frozenset({"stt_active"}), voice=("open", None))
    assert gate.blocks("prefill") and gate.blocks("decode", "background")
    assert not gate.blocks("prefill", "voice")
    gate.pause({"thermal"})
    assert gate.blocks("prefill", "voice")


def test_throttle_needs_positive_rate() -> None:
    """Throttling to zero tokens/s is refused (that is a pause)."""
    with pytest.raises(ValueError):
        DecodeGate().throttle(0)


async def test_arbiter_applies_decisions_and_logs_changes() -> None:
    """The arbiter maps a decision onto the gate and admission flags and acts only on changes."""
    gate = DecodeGate()
    unloads: list[int] = []
    seen: list[Decision] = []
    arb = Arbiter(gate, on_unload=lambda: unloads.append(1))
    arb.add_listener(seen.append)
    fired = (FiredRule("voice.stt", "pause", "stt", {"sessions": 1}, 10.0),)
    d1 = Decision(ts=11.0, policy="p", gate="paused", pause_reasons=frozenset({"stt"}), fired=fired)
    assert arb.apply(d1) is True and gate.mode == "paused" and gate.reasons == {"stt"}
    assert (
        arb.apply(Decision(ts=12.0, policy="p", gate="paused", pause_reasons=frozenset({"stt"}), fired=fired)) is False
    )
    d3 = Decision(
        ts=13.0,
        policy="p",
        gate="throttled",
        throttle_tps=5.0,
        admission="refuse_new",
        max_context=512,
        unload_llm=True,
        prefill_chunk_tokens=32,
    )
    assert arb.apply(d3) is True
    assert gate.mode == "throttled" and gate.throttle_tps == 5.0
    assert arb.refuse_new and arb.max_context == 512 and arb.prefill_chunk_tokens == 32
    assert unloads == [1] and len(seen) == 2
    arb.apply(Decision(ts=14.0, policy="p"))
    assert gate.mode == "open" and not arb.refuse_new


async def test_arbiter_loop_pauses_on_stt_and_resumes_after_holdoff() -> None:
    """The arbiter loop evaluates on every change: STT start pauses, stop resumes after the hold-off."""
    policy = Policy.model_validate(
        {"version": 1, "name": "p", "voice": {"stt": {"action": "pause", "resume_holdoff_ms": 20}}}
    )
    store = StateStore()
    gate = DecodeGate()
    arb = Arbiter(gate)
    changes: list[str] = []
    box = {"ev": anyio.Event()}

    def on_change(d: Decision) -> None:
        changes.append(d.gate)
        box["ev"].set()

    arb.add_listener(on_change)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(arb.run, store, lambda: policy)
            await box["ev"].wait()
            box["ev"] = anyio.Event()
            store.publish(VoiceActivity("stt", True, "test", session="a"))
            await box["ev"].wait()
            assert gate.mode == "paused"
            box["ev"] = anyio.Event()
            stopped = time.monotonic()
            store.publish(VoiceActivity("stt", False, "test", session="a"))
            store.publish(TelemetrySample("simulated"))
            await box["ev"].wait()
            assert gate.mode == "open" and time.monotonic() - stopped >= 0.02
            tg.cancel_scope.cancel()
    assert changes == ["open", "paused", "open"]
