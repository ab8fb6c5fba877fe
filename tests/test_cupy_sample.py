"""Sampling on the device (`engine.backends.cupy_sample.DeviceSampler`, `CupyDecoder.sample`):
the host `Sampler`'s token for the same uniform draw, seeded generation through the decoder,
zero allocations in steady-state sampled decode.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

import anyio  # noqa: E402

from engine import SamplingParams, load_model  # noqa: E402
from engine.backends.cupy_decoder import CupyDecoder  # noqa: E402
from engine.backends.cupy_sample import DeviceSampler, reference_sample  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.synth import write_synthetic_gguf  # noqa: E402
from tests.cuda_alloc import allocates_nothing  # noqa: E402
from tests.sampling_cases import PARAMS, check_plan, host_plan, random_history, random_row  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SHAPE = dict(n_layers=2, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, n_vocab=5000)


@pytest.mark.parametrize("vocab", [151936, 49152, 1000, 7])
def test_device_token_matches_host_sampler(vocab: int) -> None:
    """For every parameter combination and many draws u: the device token == `Sampler.pick`'s
    (except u within 1e-5 of a cumulative boundary; >= 99.5% exact, greedy 100%) and == the
    NumPy twin of the device algorithm."""
    rng = np.random.default_rng(41)
    ds = DeviceSampler(vocab, max_history=256)
    n = agree = 0
    report = []
    for name, p in sorted(PARAMS.items()):
        greedy = p.temperature <= 0
        for _ in range(2):
            x, hist = random_row(rng, vocab), random_history(rng, vocab)
            xd = cp.asarray(x)
            plan = host_plan(x, p, hist)
            us = rng.random(5 if vocab == 151936 else 30)
            check_plan(plan, x, p, hist, us[:2])
            for u in us:
                got = ds.sample(xd, p, float(u), hist)
                want = plan.token(float(u))
                assert got == reference_sample(x, p, float(u), hist), (name, float(u))
                n += 1
                agree += got == want
                if got != want:
                    report.append((name, float(u), got, want))
                    assert not greedy and plan.ambiguous(float(u)), (name, float(u), got, want)
    print(f"vocab {vocab}: {agree}/{n} exact; boundary cases {report}")
    assert agree / n >= 0.995


def test_device_sampler_latency_is_reported() -> None:
    """Prints the time of one sample (defaults and full-vocabulary temperature) on a 151936
    vocab, graph replay; asserts only that the draws are valid ids."""
    rng = np.random.default_rng(69)
    ds = DeviceSampler(151936)
    xd = cp.asarray(random_row(rng, 151936))
    hist = random_history(rng, 151936, 64)
    for name in ("defaults", "temperature", "all", "greedy_penalty"):
        p = PARAMS[name]
        for _ in range(3):
            ds.sample(xd, p, 0.5, hist)
        t0 = time.perf_counter()
        ids = [ds.sample(xd, p, float(u), hist) for u in rng.random(200)]
        dt = (time.perf_counter() - t0) / 200
        print(f"device sample {name}: {dt * 1e6:.1f} us")
        assert all(0 <= i < 151936 for i in ids)


def test_eager_launches_equal_graph_replay() -> None:
    """Without CUDA graphs the same launches give the same tokens."""
    rng = np.random.default_rng(86)
    a, b = DeviceSampler(49152), DeviceSampler(49152, use_graph=False)
    for name, p in sorted(PARAMS.items()):
        x, hist = cp.asarray(random_row(rng, 49152)), random_history(rng, 49152)
        for u in rng.random(10):
            assert a.sample(x, p, float(u), hist) == b.sample(x, p, float(u), hist), name
    assert a._graphs and all(g is not None for g in a._graphs.values())


def _generate(model: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    async def run() -> list[int]:
        return [ev.id async for ev in model.generate(prompt, params)]

    return anyio.run(run)


def test_seeded_generation_samples_on_the_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Model.generate with sampling on cupy: every decode step goes through the device sampler;
    the same seed twice gives the same tokens, and so does sampling the decoder's logits on the
    host with the same draws."""
    p = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", weight_type="Q4_K", seed=9, **SHAPE)
    m = load_model(p, backend="cupy", n_ctx=256)
    assert isinstance(m.decoder, CupyDecoder)
    prompt = np.random.default_rng(3).integers(0, SHAPE["n_vocab"], 12).tolist()
    params = SamplingParams(
        temperature=0.9,
        top_k=200,
        top_p=0.95,
        min_p=0.01,
        repeat_penalty=1.1,
        max_tokens=64,
        ignore_eos=True,
        seed=1234,
    )
    # one run first, so every compared run takes the same path: the prompt's K/V from the prefix
    # cache and its last token through the decoder (a first run prefills it from the first-chunk
    # graph, whose padded GEMMs may round a q8 step differently: another, equally valid, draw)
    _generate(m, prompt, params)
    ds = m.decoder.device_sampler
    before = ds.launches
    a = _generate(m, prompt, params)
    assert len(a) == 64 and ds.launches - before == 63  # the first token comes from the prefill
    b = _generate(m, prompt, params)
    assert a == b
    # the same steps one at a time (the decode loop on the device off), then sampled on the host
    monkeypatch.setattr(m, "options", replace(m.options, cupy_device_loop=False))
    chained = m.decoder.chained.launches
    assert _generate(m, prompt, params) == a and m.decoder.chained.launches == chained

    def host_sample(self: CupyDecoder, token: int, pos: int, sp: SamplingParams, u: float, history: Any) -> int:
        return Sampler(sp).pick(self.logits(token, pos), u, history)

    monkeypatch.setattr(CupyDecoder, "sample", host_sample)
    c = _generate(m, prompt, params)
    assert c == a
    assert len(set(a)) > 5  # really sampled


def test_sampled_decode_allocates_nothing(tmp_path: Path) -> None:
    """200 sampled decode steps (all stages on) through Model.step_sample: no pool allocation,
    no device allocation, pool bytes unchanged."""
    p = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", weight_type="Q4_K", seed=5, **SHAPE)
    m = load_model(p, backend="cupy", n_ctx=512, kv_dtype="f16")
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=1))
    prompt = np.random.default_rng(1).integers(0, SHAPE["n_vocab"], 16).tolist()
    m.transformer.kv.tokens = []
    tok = int(np.argmax(m.step_logits(prompt, 0)))
    hist = list(prompt) + [tok]
    pos = len(prompt)
    for _ in range(8):  # warm: the first sampled step captures the sampler's graph
        tok = m.step_sample(tok, pos, sampler, hist)
        hist.append(tok)
        pos += 1
    launches = m.decoder.device_sampler.launches
    with allocates_nothing():
        for _ in range(200):
            tok = m.step_sample(tok, pos, sampler, hist)
            hist.append(tok)
            pos += 1
    assert m.decoder.device_sampler.launches - launches == 200
