"""The issue's acceptance on the real engine (SmolLM2, CPU): voice pauses, thermal throttling, loop lag."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from engine import SamplingParams
from genie_supervisor.app import Supervisor
from genie_supervisor.arbiter import DecodeGate
from genie_supervisor.llm.host import HostedGeneration
from genie_supervisor.telemetry import SimulatedSource
from tests.awaitlog import Arrivals
from tests.clock import FakeClock
from tests.daemon import client, make_supervisor, wait_for, write_policy
from tests.models import SMOLLM2, require, shared_model

pytestmark = pytest.mark.timeout(300)

PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
N_TOKENS = 28
HOLDOFF_MS = 300
_REFERENCE: dict[str, Any] = {}


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=N_TOKENS, temperature=0.0)


class Consumer:
    """Pulls tokens from a generation in its own task and timestamps them; `wait_tokens` awaits progress."""

    def __init__(self, gen: HostedGeneration) -> None:
        self.gen = gen
        self.times = Arrivals()
        self.done = self.times.done

    async def run(self) -> None:
        async with self.gen:
            async for _tok in self.gen:
                self.times.add(time.monotonic())
        self.times.finish()

    async def wait_tokens(self, n: int) -> None:
        await self.times.wait_len(n)


class SteppingGate(DecodeGate):
    """A DecodeGate on a fake clock that counts the decode steps asking it and the ones it paced through."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.asked = 0
        """Decode steps that called `wait`."""
        self.passed = 0
        """Decode steps that `wait` let through."""
        self.paced = 0
        """Of those, the ones let through while throttled."""
        self._counted: anyio.Event | None = None

    async def wait(self, phase: str, priority: str | None = None) -> None:
        if phase != "decode":
            return await super().wait(phase, priority)
        self.asked += 1
        self._changed_count()
        await super().wait(phase, priority)
        self.passed += 1
        self.paced += self.mode == "throttled"
        self._changed_count()

    def _changed_count(self) -> None:
        if self._counted is not None:
            self._counted.set()
            self._counted = None

    async def held_after(self, paced: int) -> None:
        """Wait until `paced` decode steps went through throttled and the next one waits at the gate (a step
        that may pass returns from `wait` without a checkpoint, so a step asked and not passed is held)."""
        while not (self.paced == paced and self.asked == self.passed + 1):
            assert self.paced <= paced, (self.paced, paced)
            self._counted = self._counted or anyio.Event()
            await self._counted.wait()


async def reference(sup: Supervisor) -> dict[str, Any]:
    """The uninterrupted greedy text and decode speed (computed once, open gate)."""
    if not _REFERENCE:
        gen = await sup.engine.generate(PROMPT, greedy())
        text = await gen.collect()
        assert gen.finish_reason == "length", gen.finish_reason
        _REFERENCE.update(text=text, tps=gen.stats.decode_tps)
    return _REFERENCE


async def test_stt_hint_parks_decode_until_stop_and_holdoff_and_text_is_unchanged(
    tmp_path: Path, model_loader: Any
) -> None:
    """An STT start parks the generation before its next step, no token comes while paused, it resumes after stop + hold-off, and the greedy text equals an uninterrupted run."""
    policy = write_policy(tmp_path / "p.yaml", holdoff_ms=HOLDOFF_MS)
    async with make_supervisor(tmp_path, policy=policy, model=SMOLLM2, model_loader=model_loader) as sup:
        ref = await reference(sup)
        async with client(sup) as http, anyio.create_task_group() as tg:
            health = (await http.get("/health")).json()
            assert health["backend"] in ("native", "numpy") and health["model"] and health["engine"] == "idle"
            c = Consumer(await sup.engine.generate(PROMPT, greedy()))
            tg.start_soon(c.run)
            with anyio.fail_after(120):
                await c.wait_tokens(3)
                at_hint = len(c.times)
                r = await http.post("/v1/voice/events", json={"service": "stt", "event": "start"})
                assert r.status_code == 200
                await wait_for(sup, lambda: sup.gate.mode == "paused")
                assert await sup.gate.wait_parked(30) is True
                at_park = len(c.times)
                assert at_park - at_hint <= 1  # only the step already running when the hint came
                assert sup.engine.state == "paused"
                await anyio.sleep(1.0)  # an observation window, not a synchronisation
                assert len(c.times) == at_park
                t_stop = time.monotonic()
                await http.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
                await c.wait_tokens(at_park + 1)
                assert c.times[at_park] - t_stop >= HOLDOFF_MS / 1000.0
                await c.done.wait()
        metrics = sup.gate.metrics()
        assert metrics["reactions"] == 1 and metrics["reaction_ms_last"] is not None
        assert metrics["pauses_total"] == {"stt": 1} and metrics["paused_seconds"]["stt"] >= 1.0
        print(f"\npause reaction {metrics['reaction_ms_last']:.1f} ms (hint -> parked)")
        assert c.gen.finish_reason == "length"
        assert c.gen.text == ref["text"]


async def test_thermal_level_throttles_to_cap_with_hysteresis(tmp_path: Path, model_loader: Any) -> None:
    """Crossing the warm level throttles decode to its cap (on the gate's fake clock: no step until the next
    slot, one step per 1/cap s), the level holds until the temperature falls below leave_c, and the text is
    unchanged."""
    source = SimulatedSource(temps_c={"cpu": 50.0})
    clock = FakeClock()
    gate = SteppingGate(clock)
    cap = 10.0
    async with make_supervisor(
        tmp_path,
        policy=write_policy(tmp_path / "p0.yaml"),
        model=SMOLLM2,
        model_loader=model_loader,
        source=source,
        gate=gate,
    ) as sup:
        ref = await reference(sup)
        write_policy(tmp_path / "p0.yaml", "capped", cap=cap)
        assert await sup.reload_policy()
        async with anyio.create_task_group() as tg:
            c = Consumer(await sup.engine.generate(PROMPT, greedy()))
            tg.start_soon(c.run)
            with anyio.fail_after(200):
                await c.wait_tokens(2)
                source.set(temps_c={"cpu": 85.0})
                await wait_for(sup, lambda: sup.gate.mode == "throttled")
                assert sup.gate.throttle_tps == cap
                # the clock stands still: the first paced step runs at once, the next one waits for its slot
                await gate.held_after(1)
                for k in range(2, 5):  # each slot (1/cap s on the fake clock) lets exactly one step through
                    clock.advance(1.0 / cap)
                    await gate.held_after(k)
                assert not c.done.is_set() and sup.engine.state == "throttled"
                assert sup.gate.metrics()["throttle_wait_seconds"] > 0

                def evaluated_at(temp: float) -> bool:
                    snap = sup.store.snapshot()
                    return (
                        snap.telemetry is not None
                        and snap.telemetry.temps_c.get("cpu") == temp
                        and snap.decision is not None
                        and snap.decision.ts >= snap.telemetry.ts
                    )

                source.set(temps_c={"cpu": 75.0})  # below enter_c, above leave_c: stays warm
                await wait_for(sup, lambda: evaluated_at(75.0))
                assert sup.gate.mode == "throttled" and sup.store.snapshot().decision.thermal_level == "warm"  # type: ignore[union-attr]
                source.set(temps_c={"cpu": 65.0})  # below leave_c: back to open
                await wait_for(sup, lambda: sup.gate.mode == "open")
                assert sup.store.snapshot().decision.thermal_level is None  # type: ignore[union-attr]
                await c.done.wait()
        assert c.gen.text == ref["text"]


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


async def _lag_samples(stop: anyio.Event, out: list[float], period: float = 0.005) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        await anyio.sleep(period)
        out.append(time.monotonic() - t0 - period)


async def test_loop_lag_stays_low_while_cpu_engine_decodes(tmp_path: Path, model_loader: Any) -> None:
    """Event-loop lag while the CPU engine decodes is measured and reported; p99 stays under a generous 250 ms."""
    async with make_supervisor(
        tmp_path, policy=write_policy(tmp_path / "p.yaml"), model=SMOLLM2, model_loader=model_loader
    ) as sup:
        idle: list[float] = []
        busy: list[float] = []
        with anyio.fail_after(120):
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_lag_samples, stop, idle)
                await anyio.sleep(0.5)  # the idle measurement window
                stop.set()
            stop = anyio.Event()
            gen = await sup.engine.generate(PROMPT, greedy())
            async with anyio.create_task_group() as tg:
                tg.start_soon(_lag_samples, stop, busy)
                await gen.collect()
                stop.set()
        p50, p99 = statistics.median(busy) * 1000, _percentile(busy, 0.99) * 1000
        print(
            f"\nloop lag while decoding: p50 {p50:.2f} ms, p99 {p99:.2f} ms over {len(busy)} samples; "
            f"idle p99 {_percentile(idle, 0.99) * 1000:.2f} ms"
        )
        assert len(busy) > 10
        assert p99 < 250


async def test_shutdown_cancels_a_parked_generation(tmp_path: Path, model_loader: Any) -> None:
    """Leaving the supervisor while a generation is parked ends it as cancelled within the 5 s budget."""
    sup = make_supervisor(tmp_path, policy=write_policy(tmp_path / "p.yaml"), model=SMOLLM2, model_loader=model_loader)
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            await sup.__aenter__()
            c = Consumer(await sup.engine.generate(PROMPT, greedy()))
            tg.start_soon(c.run)
            await c.wait_tokens(1)
            sup.voice.handle({"service": "stt", "event": "start"}, "test")
            await wait_for(sup, lambda: sup.gate.mode == "paused")
            assert await sup.gate.wait_parked(30)
            t0 = time.monotonic()
            await sup.__aexit__(None, None, None)
            await c.done.wait()
            assert time.monotonic() - t0 < 5.0
    assert c.gen.finish_reason == "cancelled"
    assert sup.store.snapshot().engine.state == "disabled"  # type: ignore[union-attr]


async def test_policy_layer_group_reaches_the_engine_and_follows_reloads(tmp_path: Path) -> None:
    """`voice.prefill_layer_group` from the policy is the layer group of the next generation, and a reload changes it."""
    model = shared_model(require(SMOLLM2))
    groups: list[Any] = []

    class Recording:
        """The real model, noting the layer group each generation is started with."""

        def __getattr__(self, name: str) -> Any:
            return getattr(model, name)

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            groups.append(kwargs.get("prefill_layer_group"))
            return model.generate(*args, **kwargs)

    policy = write_policy(tmp_path / "p.yaml", "grouped")
    policy.write_text(
        policy.read_text().replace("prefill_chunk_tokens: 16", "prefill_chunk_tokens: 16\n  prefill_layer_group: 5"),
        encoding="utf-8",
    )
    async with make_supervisor(
        tmp_path, policy=policy, model=SMOLLM2, model_loader=lambda *_a, **_k: Recording()
    ) as sup:
        short = SamplingParams(max_tokens=2, temperature=0.0)
        await (await sup.engine.generate(PROMPT, short)).collect()
        write_policy(policy, "whole-chunks")
        assert await sup.reload_policy()
        await (await sup.engine.generate(PROMPT, short)).collect()
    assert groups == [5, 0]
