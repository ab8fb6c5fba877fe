"""The decode loop chained on the device, host side (`engine.decode_chain`, `Generation._chained`),
on the real SmolLM2 model with the device faked at the hardware boundary: a fake device chain
runs each step when it is queued (the CPU forward pass and `Sampler.pick`), with the device's
semantics - the next step feeds the previous step's pick, the repetition window is a ring - and
hands a token back only when it is waited for. Checked: the tokens, text and finish reasons of
the step-by-step path, a step kept queued ahead, the cache's token list, the gate before every
launch, nothing queued while parked, and a cancelled or stopped generation leaving nothing queued.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

import engine.decode_chain
from engine import Model, SamplingParams
from engine.decode_chain import DecodeChain
from engine.sampler import Sampler
from tests.models import SMOLLM2, shared_model
from tests.test_generate import assert_model_free, cancel_after

pytestmark = pytest.mark.timeout(120)


class FakeDeviceChain:
    """The device side of a chain (`engine.backends.cupy_chain.CupyChain`'s interface) on the CPU."""

    slots = 4

    def __init__(self, model: Model) -> None:
        self.tf = model.transformer
        self.pending: dict[int, int] = {}
        """slot -> token of the steps queued and not waited for."""
        self.launches = 0
        self.most_pending = 0
        self.pending_at_launch: list[int] = []
        """Steps queued right after each launch."""
        self.token = self.pos = self.w = self.cap = 0
        self.ring: list[int] = []
        self.params = SamplingParams()

    def begin(self, token: int, pos: int, params: SamplingParams, window: list[int]) -> None:
        assert not self.pending, "a chain starts with nothing queued"
        self.token, self.pos, self.params = token, pos, params
        pen = params.repeat_penalty != 1.0 and params.repeat_last_n > 0
        self.cap = params.repeat_last_n if pen else 0
        assert len(window) <= self.cap
        self.ring = list(window) + [0] * (self.cap - len(window))
        self.w = len(window) % self.cap if self.cap else 0

    def launch(self, slot: int, u: float, n_recent: int, pos: int) -> None:
        assert slot not in self.pending, "a slot reused while its step is queued"
        assert pos == self.pos, "the host's position is the device's"
        logits = self.tf.ops.to_host(self.tf.forward([self.token], self.pos, last_n=1))[0]
        pick = Sampler(self.params).pick(logits, u, self.ring[:n_recent])
        self.pending[slot] = pick
        self.most_pending = max(self.most_pending, len(self.pending))
        self.pending_at_launch.append(len(self.pending))
        self.launches += 1
        self.token, self.pos = pick, self.pos + 1  # chain_advance
        if self.cap:
            self.ring[self.w] = pick
            self.w = (self.w + 1) % self.cap

    def wait(self, slot: int) -> int:
        return self.pending.pop(slot)


def _fake_chain(model: Model, mp: pytest.MonkeyPatch, ahead_max_s: float = 3600.0) -> list[FakeDeviceChain]:
    """Make `model.decode_chain` hand out chains on fake devices; the list collects them. Steps of
    up to `ahead_max_s` keep one queued ahead (default: all, as GPU steps of a few ms do; a CPU
    step here takes longer than the engine's bound)."""
    made: list[FakeDeviceChain] = []
    mp.setattr(engine.decode_chain, "AHEAD_MAX_STEP_S", ahead_max_s)

    def decode_chain(sampler: Sampler, history: list[int]) -> DecodeChain:
        made.append(FakeDeviceChain(model))
        return DecodeChain(model.transformer, model._thread_lock, sampler, history, made[-1])

    mp.setattr(model, "decode_chain", decode_chain)
    return made


async def _run(model: Model, ids: list[int], params: SamplingParams, gate: Any = None) -> tuple[list[int], Any]:
    model.transformer.kv.tokens = []
    g = model.generate(ids, params, gate)
    out = [ev.id async for ev in g]
    return out, g


def _cache_consistent(model: Model, seq: list[int]) -> bool:
    """The cache's token list is a prefix of `seq` covering all of it but at most the last id."""
    kv = model.transformer.kv.tokens
    return kv == seq[: len(kv)] and len(kv) >= len(seq) - 1


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(
        temperature=0.9,
        top_k=30,
        top_p=0.9,
        min_p=0.02,
        repeat_penalty=1.3,
        repeat_last_n=4,
        seed=7,
        max_tokens=24,
        ignore_eos=True,
    ),
    SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=64, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40, stop=("9",)),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled-penalty-ring", "greedy-penalty", "stop"])
async def test_chained_generation_equals_stepwise(params: SamplingParams, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chained steps give the step-by-step path's tokens, text and finish reason (seeded draws in
    step order, the penalty's window as a ring), keep one step queued ahead, and leave the cache
    holding the generated sequence."""
    model = shared_model(SMOLLM2)
    ids = model.tokenizer.encode("1, 2, 3, 4, 5, 6, 7,", add_special=True)
    want, g0 = await _run(model, ids, params)
    with monkeypatch.context() as mp:
        made = _fake_chain(model, mp)
        got, g1 = await _run(model, ids, params)
    assert got == want and g1.text == g0.text and g1.finish_reason == g0.finish_reason
    dev = made[0]
    assert dev.most_pending == 2 and not dev.pending
    n = g1.stats.completion_tokens
    assert n - 1 <= dev.launches <= n  # a stop may leave one step made past it, dropped
    assert _cache_consistent(model, ids + g1.completion_ids)
    assert g1.stats.decode_s > 0


async def test_gate_is_awaited_before_every_chained_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a gate that cannot say whether it would park (no `blocks`), every launch follows a
    gate wait and the queued step is finished before it: one wait per step, the step-by-step tokens."""
    model = shared_model(SMOLLM2)
    calls: list[str] = []

    class CountingGate:
        async def wait(self, phase: str) -> None:
            calls.append(phase)

    ids = model.tokenizer.encode("The kitchen lights are", add_special=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want, _ = await _run(model, ids, params)
    with monkeypatch.context() as mp:
        made = _fake_chain(model, mp)
        got, g = await _run(model, ids, params, CountingGate())
    assert got == want
    assert calls.count("decode") == g.stats.completion_tokens - 1 == made[0].launches
    assert made[0].most_pending == 1


async def test_pause_waits_for_the_queued_step_and_nothing_runs_while_parked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause after a token: the step queued ahead is finished before the park, nothing is queued
    or launched while parked, and the generation then goes on to the uninterrupted tokens."""
    model = shared_model(SMOLLM2)
    ids = model.tokenizer.encode("Once upon a time", add_special=True)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want, _ = await _run(model, ids, params)

    class PausingGate:
        paused = False
        parked: list[tuple[int, int]] = []

        def blocks(self, phase: str) -> bool:
            return self.paused

        async def wait(self, phase: str) -> None:
            if self.paused:
                dev = made[0]
                before = (len(dev.pending), dev.launches)
                for _ in range(5):  # the event loop runs while parked
                    await anyio.lowlevel.checkpoint()
                self.parked.append(before)
                assert (len(dev.pending), dev.launches) == before
                self.paused = False

    gate = PausingGate()
    model.transformer.kv.tokens = []
    with monkeypatch.context() as mp:
        made = _fake_chain(model, mp)
        g = model.generate(ids, params, gate)
        got = []
        async for ev in g:
            got.append(ev.id)
            if len(got) == 6:
                gate.paused = True
    assert got == want
    assert len(gate.parked) == 1 and gate.parked[0][0] == 0  # parked with nothing queued


async def test_cancel_leaves_nothing_queued_and_the_model_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing a chained generation mid-stream waits for the step queued ahead, frees the model and
    leaves the cache holding the tokens whose K/V were written."""
    model = shared_model(SMOLLM2)
    ids = model.tokenizer.encode("Once upon a time", add_special=True)
    with monkeypatch.context() as mp:
        made = _fake_chain(model, mp)
        model.transformer.kv.tokens = []
        g = await cancel_after(model, ids)
    assert g.finish_reason == "cancelled" and g.stats.completion_tokens == 3
    assert not made[0].pending and made[0].launches == 3  # two read, one queued ahead
    kv = model.transformer.kv.tokens
    assert kv[: len(ids) + 3] == ids + g.completion_ids and len(kv) == len(ids) + 3
    await assert_model_free(model)


async def test_long_steps_run_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a step has taken longer than the bound for queuing ahead, no further step is queued
    ahead (a pause then lands within one step); the tokens stay the step-by-step ones."""
    model = shared_model(SMOLLM2)
    ids = model.tokenizer.encode("The kitchen lights are", add_special=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want, _ = await _run(model, ids, params)
    with monkeypatch.context() as mp:
        made = _fake_chain(model, mp, ahead_max_s=0.0)
        got, _ = await _run(model, ids, params)
    assert got == want
    pending = made[0].pending_at_launch
    assert pending[:3] == [1, 2, 2]  # queued ahead until a step was measured
    assert set(pending[3:]) == {1}  # then one at a time


async def test_yield_to_an_urgent_generation_leaves_nothing_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chained background generation yields the model to a more urgent one with no step of its
    own queued, gets its context rebuilt afterwards and runs to its full length; the urgent one
    gives its uninterrupted tokens."""
    model = shared_model(SMOLLM2)
    bg_ids = model.tokenizer.encode("Tell me a long story about a lighthouse keeper.", add_special=True)
    fg_ids = model.tokenizer.encode("Turn on the kitchen lights.", add_special=True)
    fg_params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want_fg, _ = await _run(model, fg_ids, fg_params)
    model.transformer.kv.tokens = []
    queued_at_fg: list[int] = []
    with monkeypatch.context() as mp:
        made = _fake_chain(model, mp)
        bg = model.generate(bg_ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), priority=0)
        started = anyio.Event()
        order: list[str] = []
        fg_tokens: list[int] = []

        async def background() -> None:
            async for _ in bg:
                started.set()
            order.append("bg")

        async def urgent() -> None:
            await started.wait()
            fg = model.generate(fg_ids, fg_params, priority=2)
            async for ev in fg:
                if not fg_tokens:
                    queued_at_fg.append(len(made[0].pending))  # the background's device, while fg runs
                fg_tokens.append(ev.id)
            order.append("fg")

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(background)
                tg.start_soon(urgent)
    assert order == ["fg", "bg"] and bg.preemptions >= 1
    assert queued_at_fg == [0]
    assert fg_tokens[: len(want_fg)] == want_fg
    assert bg.finish_reason == "length" and bg.stats.completion_tokens == 12
    assert not made[0].pending
    assert _cache_consistent(model, bg_ids + bg.completion_ids)
