"""Sampling and generation on the real SmolLM2 model: stops, seeds, gates, cancellation, caching."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from engine import Generation, Model, SamplingParams, TokenEvent
from engine.generate import _StopMatcher
from engine.sampler import Sampler
from tests.models import SMOLLM2, shared_model

pytestmark = pytest.mark.timeout(120)


def _model():  # type: ignore[no-untyped-def]
    return shared_model(SMOLLM2)


async def _collect(gen) -> list[TokenEvent]:  # type: ignore[no-untyped-def]
    return [tok async for tok in gen]


async def cancel_after(model: Model, ids: list[int], n: int = 3) -> Generation:
    """A greedy generation of `ids` (up to 200 tokens) read for `n` tokens, then closed: the consumer went away."""
    g = model.generate(ids, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    k = 0
    async for _ in g:
        k += 1
        if k == n:
            break
    await g.aclose()
    return g


async def assert_model_free(model: Model) -> None:
    """The model's lock can be taken at once (within 5 s): no closed generation still holds it."""
    with anyio.fail_after(5):
        async with model.lock.hold():
            pass


def test_sampler_greedy_and_topk1_pick_argmax() -> None:
    """Temperature 0 and top-k 1 both return the argmax."""
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0))(logits) == 1
    assert Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))(logits) == 1


def test_sampler_same_seed_same_tokens() -> None:
    """The same seed gives the same draws; another seed gives different ones."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, 100)).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    a = [Sampler(p)(r) for r in rows]
    s1 = Sampler(p)
    b = [s1(r) for r in rows]
    s2 = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=43))
    c = [s2(r) for r in rows]
    assert a[0] == b[0] and b != c


def test_sampler_top_p_and_min_p_cut_the_tail() -> None:
    """top-p and min-p never pick tokens outside their kept set."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=1))
    assert {s(logits) for _ in range(200)} <= {0, 1}
    m = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=1))
    assert {m(logits) for _ in range(200)} <= {0, 1}


def test_repetition_penalty_lowers_seen_tokens() -> None:
    """A strong repetition penalty moves greedy away from a token already in the history."""
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))(logits, [0]) == 1


def test_stop_matcher_holds_partial_stop_strings() -> None:
    """Text that may start a stop string is held back, and released when it does not."""
    m = _StopMatcher(["STOP"])
    assert m.push("hello ST") == ("hello ", False)
    assert m.push("ART") == ("START", False)
    assert m.push(" x STO") == (" x ", False)
    assert m.push("P tail") == ("", True)


async def test_greedy_generation_is_deterministic_and_prefix_cached() -> None:
    """Greedy text is the same twice; the second run reuses the cached prompt prefix."""
    model = _model()
    ids = model.encode_chat([{"role": "user", "content": "Name a fruit."}])
    g1 = model.generate(ids, SamplingParams(temperature=0, max_tokens=12))
    t1 = "".join(t.text for t in await _collect(g1))
    g2 = model.generate(ids, SamplingParams(temperature=0, max_tokens=12))
    t2 = "".join(t.text for t in await _collect(g2))
    assert t1 == t2 == g1.text and t1
    assert g2.stats.cached_tokens == len(ids) - 1
    assert g1.finish_reason in ("length", "stop")


async def test_max_tokens_and_stop_strings_end_generation() -> None:
    """max_tokens caps the count; a stop string ends it and is not included."""
    model = _model()
    ids = model.tokenizer.encode("1, 2, 3, 4, 5, 6,", add_special=True)
    g = model.generate(ids, SamplingParams(temperature=0, max_tokens=5))
    toks = await _collect(g)
    assert len([t for t in toks if t.id >= 0]) <= 5 and g.finish_reason == "length"
    g = model.generate(ids, SamplingParams(temperature=0, max_tokens=30, stop=["9"]))
    await _collect(g)
    assert g.finish_reason == "stop" and "9" not in g.text and "8" in g.text


async def test_gate_is_awaited_before_every_step() -> None:
    """The gate is awaited once per prefill chunk and once per decode step."""
    model = _model()
    calls: list[str] = []

    class CountingGate:
        async def wait(self, phase: str) -> None:
            calls.append(phase)

    ids = model.tokenizer.encode("The kitchen lights are", add_special=True)
    model.transformer.kv.tokens = []
    g = model.generate(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), CountingGate(), 2)
    await _collect(g)
    assert calls.count("prefill") == -(-len(ids) // 2)
    assert calls.count("decode") == g.stats.completion_tokens - 1


async def test_cancel_stops_within_one_step() -> None:
    """Leaving the loop and closing the generation stops it; the model is free right after."""
    model = _model()
    g = await cancel_after(model, model.tokenizer.encode("Once upon a time", add_special=True))
    assert g.finish_reason == "cancelled" and g.stats.completion_tokens == 3
    await assert_model_free(model)


async def test_streamed_text_handles_multibyte_characters() -> None:
    """Concatenated streamed pieces equal the decoded completion, even across split characters."""
    model = _model()
    ids = model.encode_chat([{"role": "user", "content": "Write the word café and an emoji."}])
    g = model.generate(ids, SamplingParams(temperature=0, max_tokens=24))
    text = "".join(t.text for t in await _collect(g))
    assert text == model.tokenizer.decode(g.completion_ids)


async def test_layer_groups_await_the_gate_inside_chunks_and_keep_the_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With prefill_layer_group G the gate is awaited between groups of G layers inside every
    chunk (a pause there parks with the activations kept), and the prompt's logits and the
    generated tokens equal a whole-chunk prefill's exactly."""
    model = _model()
    n_layers = len(model.transformer.layers)
    ids = model.tokenizer.encode("The kitchen lights are on and the oven is warm", add_special=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    model.transformer.kv.tokens = []
    want = None
    for pos in range(0, len(ids), 4):
        want = model.step_logits(ids[pos : pos + 4], pos)
    model.transformer.kv.tokens = []
    want_tokens = [t.id for t in await _collect(model.generate(ids, params, None, 4))]
    got: list[np.ndarray] = []
    layers = model.prefill_layers

    def record(*a):  # type: ignore[no-untyped-def]
        out = layers(*a)
        if out is not None:
            got.append(out)
        return out

    monkeypatch.setattr(model, "prefill_layers", record)
    calls: list[tuple[str, int]] = []

    class CountingGate:
        async def wait(self, phase: str) -> None:
            calls.append((phase, len(model.transformer.kv.tokens)))
            await anyio.lowlevel.checkpoint()  # a park between two groups: the loop runs, nothing is lost

    model.transformer.kv.tokens = []
    g = model.generate(ids, params, CountingGate(), 4, prefill_layer_group=8)
    tokens = [t.id for t in await _collect(g)]
    chunks = -(-len(ids) // 4)
    groups = -(-n_layers // 8)
    # the cache counts a chunk's tokens once all its groups ran
    assert [n for p, n in calls if p == "prefill"] == [4 * c for c in range(chunks) for _ in range(groups)]
    assert got and np.array_equal(got[-1], want)
    assert tokens == want_tokens


async def test_layer_groups_keep_one_piece_queued_and_finish_it_before_a_park(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a backend with device events, a layer-group prefill keeps the newest piece queued while
    the gate stays open (a piece is waited for only once the next one is queued behind it), waits
    for the queued piece before it parks (a parked engine leaves nothing queued), and generates
    the tokens of a whole-chunk prefill."""
    model = _model()
    ids = model.tokenizer.encode("The kitchen lights are on and the oven is warm", add_special=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    model.transformer.kv.tokens = []
    want_tokens = [t.id for t in await _collect(model.generate(ids, params, None, 4))]
    log: list[str] = []
    made: list[int] = []

    class Event:
        def __init__(self, n: int) -> None:
            self.n = n

        def synchronize(self) -> None:
            log.append(f"wait {self.n}")

    def mark() -> Event:
        made.append(len(made))
        log.append(f"queue {made[-1]}")
        return Event(made[-1])

    monkeypatch.setattr(model.transformer.ops, "mark", mark, raising=False)

    class PausingGate:
        """Open, except once: paused at the checkpoint after the second event was queued."""

        paused = False

        def blocks(self, phase: str) -> bool:
            if phase == "prefill" and len(made) == 2 and "park" not in log:
                self.paused = True
            return self.paused

        async def wait(self, phase: str) -> None:
            if self.paused:
                log.append("park")
                self.paused = False
            await anyio.lowlevel.checkpoint()

    model.transformer.kv.tokens = []
    tokens = [t.id for t in await _collect(model.generate(ids, params, PausingGate(), 4, prefill_layer_group=8))]
    assert tokens == want_tokens
    assert "park" in log and log[log.index("park") - 1] == "wait 1"  # the queued piece finished first
    for entry in log:
        if entry.startswith("wait ") and log.index(entry) < log.index("park") - 1:
            n = int(entry.split()[1])
            assert log.index(f"queue {n + 1}") < log.index(entry)  # waited for only behind the next
    groups = -(-len(model.transformer.layers) // 8)
    assert len(made) == -(-len(ids) // 4) * (groups - 1)  # every piece but a chunk's last is queued ahead


async def test_pinned_prefix_comes_back_after_another_prompt_used_the_cache() -> None:
    """A generation with pin_prefix keeps its prompt's K/V aside: after another prompt overwrote the
    cache, the next prompt sharing that prefix starts from it (cached_tokens) and generates exactly
    the tokens of a cold run."""
    model = _model()
    system = [{"role": "system", "content": "You are a terse home assistant. Answer in one sentence."}]
    first = model.encode_chat([*system, {"role": "user", "content": "Turn on the kitchen lights."}])
    other = model.tokenizer.encode("Tell me a long story about a lighthouse keeper.", add_special=True)
    second = model.encode_chat([*system, {"role": "user", "content": "Is the oven still on?"}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    model.transformer.kv.tokens = []
    cold = [t.id for t in await _collect(model.generate(second, params))]
    model._pinned = None
    model.transformer.kv.tokens = []
    await _collect(model.generate(first, params, pin_prefix=True))
    await _collect(model.generate(other, params))
    assert model.transformer.kv.common_prefix(second) < shared  # the cache now holds the other prompt
    g = model.generate(second, params)
    assert [t.id for t in await _collect(g)] == cold
    assert g.stats.cached_tokens == shared
    model.transformer.kv.tokens = []
    g = model.generate(other, params)
    await _collect(g)
    assert g.stats.cached_tokens <= 1  # a prompt the pinned prefix does not share gets nothing back


async def _second_after_first_token(  # type: ignore[no-untyped-def]
    model, first: tuple[list[int], SamplingParams, int], second: tuple[list[int], SamplingParams, int]
):
    """Run the `first` (ids, params, priority) generation and start the `second` once the first has given a
    token; return the order in which they finished and the first generation."""
    order: list[str] = []
    started = anyio.Event()
    g = model.generate(first[0], first[1], priority=first[2])

    async def run_first() -> None:
        async for _ in g:
            started.set()
        order.append("first")

    async def run_second() -> None:
        await started.wait()
        await _collect(model.generate(second[0], second[1], priority=second[2]))
        order.append("second")

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_first)
            tg.start_soon(run_second)
    return order, g


async def test_urgent_generation_preempts_a_running_one() -> None:
    """A higher-priority generation takes the model between two steps; the other resumes after it."""
    model = _model()
    bg_ids = model.tokenizer.encode("Tell me a long story about a lighthouse keeper.", add_special=True)
    fg_ids = model.tokenizer.encode("Turn on the kitchen lights.", add_special=True)
    order, bg = await _second_after_first_token(
        model,
        (bg_ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 0),
        (fg_ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), 2),
    )
    assert order == ["second", "first"]
    assert bg.finish_reason == "length" and bg.stats.completion_tokens == 12
    assert bg.preemptions >= 1


async def test_equal_priority_waits_its_turn() -> None:
    """A generation of the same priority waits for the running one to finish (no preemption)."""
    model = _model()
    ids = model.tokenizer.encode("Count: one, two,", add_special=True)
    order, first = await _second_after_first_token(
        model,
        (ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), 1),
        (ids, SamplingParams(temperature=0, max_tokens=2), 1),
    )
    assert order == ["first", "second"]
    assert first.preemptions == 0


async def test_preempted_generation_cancelled_while_waiting_releases_cleanly() -> None:
    """A generation that yielded the model and is cancelled while queued for it leaves the lock free."""
    model = _model()
    ids = model.tokenizer.encode("Once upon a time", add_special=True)
    bg = model.generate(ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), priority=0)
    got_first = anyio.Event()
    voice_running = anyio.Event()
    release_voice = anyio.Event()

    async def background() -> None:
        async for _ in bg:
            got_first.set()

    async def voice() -> None:
        await got_first.wait()
        g = model.generate(ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), priority=2)
        async for _ in g:
            voice_running.set()
            await release_voice.wait()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(voice)
            async with anyio.create_task_group() as bg_tg:
                bg_tg.start_soon(background)
                await voice_running.wait()  # background has yielded and queues for the model
                bg_tg.cancel_scope.cancel()
            await bg.aclose()
            assert bg.preemptions == 1 and bg.finish_reason == "cancelled"
            release_voice.set()
        async with model.lock.hold():
            pass
