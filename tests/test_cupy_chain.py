"""The decode loop on the device (`engine.backends.cupy_chain`, `engine.decode_chain`): chained
steps read the previous step's token from device memory; the tokens equal the step-by-step
path's (greedy and seeded sampling with penalty ring, bias, top-k/top-p/min-p), a step stays
queued ahead, the repetition window's ring wraps, and steady-state chained decode allocates
nothing.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

import anyio  # noqa: E402

from engine import SamplingParams, load_model  # noqa: E402
from engine.sampler import Sampler  # noqa: E402
from engine.synth import write_synthetic_gguf  # noqa: E402
from tests.cuda_alloc import allocates_nothing  # noqa: E402
from tests.cupy_helpers import SHAPE  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _generate(model: Any, prompt: list[int], params: SamplingParams) -> list[int]:
    """The generated token ids (a text tail event repeats the last id: not counted)."""

    async def run() -> list[int]:
        g = model.generate(prompt, params)
        async for _ in g:
            pass
        return g.completion_ids

    return anyio.run(run)


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
    SamplingParams(temperature=0.0, repeat_penalty=1.4, repeat_last_n=8, max_tokens=64, ignore_eos=True),
    SamplingParams(
        temperature=0.9,
        top_k=50,
        top_p=0.9,
        min_p=0.02,
        repeat_penalty=1.2,
        repeat_last_n=8,
        logit_bias=((3, 2.0), (7, -100.0)),
        max_tokens=64,
        ignore_eos=True,
        seed=99,
    ),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=64, ignore_eos=True, seed=5),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "greedy-penalty", "sampled-all", "sampled-full-vocab"])
def test_chained_generation_equals_stepwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, params: SamplingParams
) -> None:
    """Model.generate with steps chained on the device gives the tokens of the same steps run one at
    a time (device loop off): the same graph, the same sampler, the draws in step order, the
    penalty's window as a ring on the device (8 ids: it wraps many times); every step chained."""
    p = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", weight_type="Q4_K", seed=4, **SHAPE)
    m = load_model(p, backend="cupy", n_ctx=256, kv_dtype="f16")
    assert m.decoder.chained is not None
    prompt = np.random.default_rng(8).integers(0, SHAPE["n_vocab"], 20).tolist()
    _generate(m, prompt, params)  # every compared run then takes the prompt from the prefix cache
    before = m.decoder.chained.launches
    a = _generate(m, prompt, params)
    assert len(a) == 64 and m.decoder.chained.launches - before == 63
    assert _generate(m, prompt, params) == a
    monkeypatch.setattr(m, "options", replace(m.options, cupy_device_loop=False))
    b = _generate(m, prompt, params)
    assert b == a and m.decoder.chained.launches - before == 2 * 63
    if params.temperature > 0:
        assert len(set(a)) > 10  # really sampled


def test_chained_decode_allocates_nothing(tmp_path: Path) -> None:
    """500 greedy and 200 sampled steps chained on the device, one queued ahead: no pool
    allocation, no device allocation, pool bytes unchanged; the tokens equal step_sample's."""
    p = write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", weight_type="Q4_K", seed=5, **SHAPE)
    m = load_model(p, backend="cupy", n_ctx=1024, kv_dtype="f16")
    prompt = np.random.default_rng(1).integers(0, SHAPE["n_vocab"], 16).tolist()
    for params, n in (
        (SamplingParams(temperature=0), 500),
        (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, seed=1), 200),
    ):
        m.transformer.kv.tokens = []
        tok0 = int(np.argmax(m.step_logits(prompt, 0)))
        history = list(prompt) + [tok0]
        chain = m.decode_chain(Sampler(params), history)
        assert chain is not None
        pos = len(prompt)
        chain.step(tok0, pos, True, False)
        for _ in range(8):  # warm: the sampler's graph is captured at first use
            history.append(chain.step(tok0, pos, True, True))
        with allocates_nothing():
            for _ in range(n):
                history.append(chain.step(tok0, pos, True, True))
        chain.settle()
        got = history[len(prompt) + 1 :]
        # the same steps through step_sample, one at a time, from the same cache
        sampler = Sampler(params)
        ref = list(prompt) + [tok0]
        m.transformer.kv.tokens = list(prompt)
        t = tok0
        for i in range(len(got)):
            t = m.step_sample(t, len(prompt) + i, sampler, ref)
            ref.append(t)
        assert ref[len(prompt) + 1 :] == got
