"""Preemption on the GPU: a pause lands between prefill pieces (chunks, groups of layers) and decode
steps, a paused engine has nothing queued and launches nothing, and a prefill paused and resumed
gives the bits of an uninterrupted one.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

import anyio  # noqa: E402

from engine import EngineOptions, Model, SamplingParams, load_model  # noqa: E402
from engine.synth import write_synthetic_gguf  # noqa: E402
from genie_supervisor.arbiter import DecodeGate  # noqa: E402
from tests.cuda_alloc import AllocCounter  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

N_LAYERS = 12
PROMPT_LEN = 1300
GREEDY = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    """A 12-layer Qwen3-shaped Q4_K model, eager prefill (first-chunk graphs off: every chunk
    can be split into layer groups)."""
    p = write_synthetic_gguf(
        tmp_path_factory.mktemp("preempt") / "m.gguf",
        "qwen3",
        weight_type="Q4_K",
        seed=5,
        n_layers=N_LAYERS,
        n_embd=512,
        n_ff=1536,
        n_heads=8,
        n_kv_heads=4,
        n_vocab=1024,
    )
    m = load_model(p, backend="cupy", n_ctx=2048, kv_dtype="f16", options=EngineOptions(cupy_prefill_graph=False))
    assert m.transformer.ops.prefill_graphs is None
    yield m


def _prompt(n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1024, n).tolist()


def _kv(m: Model, n: int) -> list[np.ndarray]:
    kv = m.transformer.kv  # f16 rows [kv_heads, n_ctx, dim]
    return [cp.asnumpy(a[:, :n]) for a in (*kv.k, *kv.v)]


def _streams_idle(m: Model) -> bool:
    """No work queued on any stream the engine uses (the thread's default stream, the decoder's)."""
    streams = [cp.cuda.Stream.null]
    if m.decoder is not None:
        streams.append(m.decoder.stream)
    return all(s.done for s in streams)


class _Calls:
    """Counts calls of every backend entry point that launches GPU work (the ops, the decoder's
    launch, the device sampler, the forward pass) while installed."""

    def __init__(self, m: Model, mp: pytest.MonkeyPatch) -> None:
        self.n = 0
        ops, tf = m.transformer.ops, m.transformer
        targets: list[tuple[Any, str]] = [
            (ops, n) for n in dir(type(ops)) if not n.startswith("__") and callable(getattr(ops, n))
        ]
        targets += [(tf, n) for n in ("forward", "begin", "run_layers", "end", "head")]
        if m.decoder is not None:
            targets += [(m.decoder, "_launch")]
            if getattr(m.decoder, "device_sampler", None) is not None:
                targets += [(m.decoder.device_sampler, n) for n in ("sample", "queue", "prepare")]
            if getattr(m.decoder, "chained", None) is not None:  # the decode loop on the device
                targets += [(m.decoder.chained, n) for n in ("begin", "launch")]
        for obj, name in targets:
            mp.setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            self.n += 1
            return fn(*a, **k)

        return counted


def _reference(m: Model, ids: list[int], chunk: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Logits of the last prompt token and every layer's K/V after an uninterrupted prefill in
    whole chunks of `chunk` tokens."""
    m.transformer.kv.tokens = []
    out: np.ndarray | None = None
    for pos in range(0, len(ids), chunk):
        out = m.step_logits(ids[pos : pos + chunk], pos)
    assert out is not None
    return out, _kv(m, len(ids))


class _PausingGate(DecodeGate):
    """A DecodeGate that pauses itself at prefill waits number `at` (a set) of a generation."""

    def __init__(self, at: set[int]) -> None:
        super().__init__()
        self.at = at
        self.prefill_waits = 0
        self.paused_evt = anyio.Event()
        """Set when the gate paused itself (a new one each time it opens)."""

    async def wait(self, phase: str) -> None:
        if phase == "prefill":
            self.prefill_waits += 1
            if self.prefill_waits in self.at:
                self.pause({"test"})
                self.paused_evt.set()
        await super().wait(phase)

    def open(self) -> None:
        self.paused_evt = anyio.Event()
        super().open()


def _recorder(m: Model, mp: pytest.MonkeyPatch) -> list[np.ndarray]:
    """The logits each whole chunk or finished layer-grouped chunk returns (last is the prompt's)."""
    got: list[np.ndarray] = []
    for name in ("step_logits", "prefill_layers"):
        fn = getattr(m, name)

        def rec(*a: Any, fn: Any = fn) -> Any:
            r = fn(*a)
            if r is not None:
                got.append(r)
            return r

        mp.setattr(m, name, rec)
    return got


async def _watch_parked(model: Model, state: dict[str, Any]) -> None:
    """Let the event loop run while the engine is parked; note in `state` whether every stream stayed
    idle (`idle`), how many backend calls (`calls`) and pool allocations (`mallocs`) happened."""
    state["idle"] = _streams_idle(model)
    with pytest.MonkeyPatch.context() as mp, AllocCounter() as alloc:
        calls = _Calls(model, mp)
        for _ in range(20):  # the event loop runs while parked: nothing reaches the GPU
            await anyio.sleep(0.005)
            state["idle"] = state["idle"] and _streams_idle(model)
        state["calls"], state["mallocs"] = calls.n, alloc.mallocs


def test_pause_during_long_prefill_parks_before_it_completes_and_launches_nothing(
    model: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pause requested in the middle of a 1,300-token prefill (512-token chunks, groups of 2
    layers) parks the engine between two layer groups of a chunk, before the prefill completes:
    parked, every stream is idle, no backend entry point is called and nothing is allocated
    until the gate opens; then the prefill resumes from the next layer group and ends with the
    bits of an uninterrupted prefill."""
    ids = _prompt()
    want, want_kv = _reference(model, ids, 512)
    model.transformer.kv.tokens = []
    got = _recorder(model, monkeypatch)
    gate = _PausingGate({8})  # 1 (chunk) + 6 (groups 2..6 of chunk 1) + 1: inside chunk 2
    state: dict[str, Any] = {}

    async def run() -> None:
        gen = model.generate(ids, GREEDY, gate=gate, prefill_chunk=512, prefill_layer_group=2)

        async def consume() -> None:
            async for _ in gen:
                pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(60):
                await gate.paused_evt.wait()
                assert await gate.wait_parked(60)
            state["cached"] = len(model.transformer.kv.tokens)
            state["first_token"] = gen.stats.first_token_s
            await _watch_parked(model, state)
            gate.open()
        state["waits"] = gate.prefill_waits

    anyio.run(run)
    assert state["cached"] == 512, "parked inside the second chunk: only the first is in the cache"
    assert state["first_token"] is None
    assert state["idle"] is True
    assert state["calls"] == 0 and state["mallocs"] == 0
    assert state["waits"] == 1 + 5 + 1 + 5 + 1 + 5  # three chunks of six groups (1,300 tokens)
    np.testing.assert_array_equal(got[-1], want)
    for a, b in zip(_kv(model, len(ids)), want_kv, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "chunk,group",
    [(256, 0), (512, 3), (200, 1), (512, 5)],
    ids=["chunks-256", "groups-of-3", "groups-of-1", "groups-of-5-uneven"],
)
def test_prefill_paused_at_every_piece_equals_uninterrupted(
    model: Model, monkeypatch: pytest.MonkeyPatch, chunk: int, group: int
) -> None:
    """A prefill paused (and parked) before every one of its pieces - whole chunks, or groups of
    layers inside each chunk (12 layers in groups of 5 leaves a group of 2) - and resumed each
    time gives exactly the logits and K/V rows of an uninterrupted whole-chunk prefill."""
    ids = _prompt(seed=group + chunk)
    want, want_kv = _reference(model, ids, chunk)
    model.transformer.kv.tokens = []
    got = _recorder(model, monkeypatch)
    gate = _PausingGate(set(range(2, 1000)))
    parks = 0

    async def run() -> None:
        nonlocal parks
        gen = model.generate(ids, GREEDY, gate=gate, prefill_chunk=chunk, prefill_layer_group=group)
        done = anyio.Event()

        async def consume() -> None:
            async for _ in gen:
                pass
            done.set()
            gate.paused_evt.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(120):
                while True:
                    await gate.paused_evt.wait()
                    if done.is_set():
                        break
                    assert await gate.wait_parked(60) and gate.metrics()["parked_generations"] == 1
                    assert _streams_idle(model)
                    parks += 1
                    gate.open()

    anyio.run(run)
    pieces = -(-len(ids) // chunk) * (-(-N_LAYERS // group) if group else 1)
    assert parks == pieces - 1  # parked before every piece but the first
    np.testing.assert_array_equal(got[-1], want)
    for a, b in zip(_kv(model, len(ids)), want_kv, strict=True):
        np.testing.assert_array_equal(a, b)


def test_paused_decode_launches_nothing(model: Model) -> None:
    """A pause while decoding (steps chained on the device, one queued ahead) parks between two
    steps with every stream idle, and until the gate opens no backend entry point is called and
    nothing is allocated; the generation then goes on to its full length."""
    ids = _prompt(64, seed=9)
    model.transformer.kv.tokens = []
    chained = model.decoder.chained.launches
    gate = DecodeGate()
    state: dict[str, Any] = {}

    async def run() -> None:
        gen = model.generate(ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), gate=gate)
        tenth = anyio.Event()

        async def consume() -> None:
            n = 0
            async for _ in gen:
                n += 1
                if n == 10:
                    gate.pause({"test"})  # before the next decode step
                    tenth.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(30):
                await tenth.wait()
                assert await gate.wait_parked(30)
            await _watch_parked(model, state)
            gate.open()
        state["tokens"] = gen.stats.completion_tokens

    anyio.run(run)
    assert model.decoder is not None
    assert state["idle"] is True and state["calls"] == 0 and state["mallocs"] == 0
    assert state["tokens"] == 40
    assert model.decoder.chained.launches - chained == 39  # every step was a chained one
