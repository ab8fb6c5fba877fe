"""Token masks and logit bias on the device (`DeviceSampler.sample(mask=...)`, `CupyDecoder.sample`
with a `Constraint`): the host `Sampler`'s token for the same uniform draw, constrained generation
on a synthetic model that gives valid JSON, and a masked decode that allocates nothing.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

import anyio  # noqa: E402
import jsonschema  # noqa: E402

from engine import Grammar, SamplingParams, load_model  # noqa: E402
from engine.backends.cupy_decoder import CupyDecoder  # noqa: E402
from engine.backends.cupy_sample import DeviceSampler, reference_sample  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.synth import write_synthetic_gguf  # noqa: E402
from tests.cuda_alloc import AllocCounter  # noqa: E402
from tests.sampling_cases import PARAMS, host_plan, random_history, random_row  # noqa: E402
from tests.test_sampler_mask import _mask_of  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SHAPE = dict(n_layers=2, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, n_vocab=5000)
SCHEMA = {
    "type": "object",
    "properties": {
        "room": {"enum": ["kitchen", "bedroom", "hall"]},
        "on": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["room", "on", "level"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("vocab", [151936, 49152, 1000])
def test_device_mask_and_bias_give_the_host_token(vocab: int) -> None:
    """With a mask (dense or a handful of tokens) and a logit bias (-inf bans, +/- shifts), the
    device token == the NumPy twin's and == `Sampler.pick`'s for the same u (except u within 1e-5
    of a cumulative boundary); greedy exactly."""
    rng = np.random.default_rng(77)
    ds = DeviceSampler(vocab, max_history=256)
    n = agree = 0
    for name, base in sorted(PARAMS.items()):
        for density in (0.3, 8 / vocab):
            x, hist = random_row(rng, vocab), random_history(rng, vocab)
            allowed = rng.random(vocab) < density
            allowed[rng.integers(0, vocab, 3)] = True
            order = np.argsort(-x, kind="stable")
            bias = {int(order[0]): float("-inf"), int(order[5]): 3.0, int(rng.integers(0, vocab)): -2.5}
            p = replace(base, logit_bias=tuple(bias.items()))
            mask = _mask_of(allowed)
            plan = host_plan(Sampler(p).adjusted(x, mask), p, hist)
            xd = cp.asarray(x)
            for u in rng.random(4 if vocab == 151936 else 12):
                got = ds.sample(xd, p, float(u), hist, mask=mask)
                assert allowed[got] and got != int(order[0]), (name, got)
                assert got == reference_sample(x, p, float(u), hist, mask), (name, float(u))
                want = plan.token(float(u))
                n += 1
                agree += got == want
                assert got == want or plan.ambiguous(float(u)), (name, float(u), got, want)
    assert agree / n >= 0.99


def _synth(tmp_path: Path, seed: int) -> Any:
    p = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", weight_type="Q4_K", seed=seed, **SHAPE)
    return load_model(p, backend="cupy", n_ctx=512)


def _constrained(model: Any, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    async def run() -> tuple[list[int], str, str]:
        gen = model.generate(prompt, params, constraint=model.constrainer.start(Grammar.json_schema(SCHEMA)))
        ids = [ev.id async for ev in gen]
        return ids, gen.text, str(gen.finish_reason)

    return anyio.run(run)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_constrained_generation_on_the_device_gives_valid_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, temperature: float
) -> None:
    """A JSON-schema constrained generation on a synthetic model: every decode step samples on the
    device with the mask, the output ends by itself and validates, and the host path (the logits
    row brought back, the same draws) gives the same tokens."""
    m = _synth(tmp_path, 11)
    assert isinstance(m.decoder, CupyDecoder)
    prompt = np.random.default_rng(5).integers(0, SHAPE["n_vocab"], 10).tolist()
    # a random model pads every place JSON allows whitespace to the grammar's bound (24 characters)
    params = SamplingParams(temperature=temperature, max_tokens=800, seed=3)
    _constrained(m, prompt, params)  # the prompt's K/V into the prefix cache (see test_cupy_sample)
    ds = m.decoder.device_sampler
    before = ds.launches
    ids, text, finish = _constrained(m, prompt, params)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert ds.launches - before == len(ids) - 1  # the first token comes from the prefill
    monkeypatch.setattr(CupyDecoder, "takes_mask", False)
    assert _constrained(m, prompt, params)[0] == ids


def test_masked_sampled_decode_allocates_nothing(tmp_path: Path) -> None:
    """200 decode steps with a mask and a logit bias through Model.step_sample: every token is an
    allowed one, and no pool or device allocation happens."""
    m = _synth(tmp_path, 5)
    sampler = Sampler(SamplingParams(temperature=0.8, seed=1, logit_bias=((7, -np.inf), (9, 2.0))))
    allowed = np.zeros(SHAPE["n_vocab"], dtype=bool)
    allowed[100:400] = True

    class Fixed:
        words = -(-SHAPE["n_vocab"] // 32)

        def fill(self, out: np.ndarray) -> None:
            out[:] = _mask_of(allowed)

    mask: Any = Fixed()
    prompt = np.random.default_rng(1).integers(0, SHAPE["n_vocab"], 16).tolist()
    m.transformer.kv.tokens = []
    tok = int(np.argmax(m.step_logits(prompt, 0)))
    hist, pos = list(prompt) + [tok], len(prompt)
    for _ in range(8):  # warm: the first masked step captures the sampler's graph
        tok = m.step_sample(tok, pos, sampler, hist, mask)
        hist.append(tok)
        pos += 1
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    used, total = pool.used_bytes(), pool.total_bytes()
    hook = AllocCounter()
    with hook:
        for _ in range(200):
            tok = m.step_sample(tok, pos, sampler, hist, mask)
            assert allowed[tok]
            hist.append(tok)
            pos += 1
    cp.cuda.Device().synchronize()
    assert (hook.mallocs, hook.allocs) == (0, 0)
    assert (pool.used_bytes(), pool.total_bytes()) == (used, total)
