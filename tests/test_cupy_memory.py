"""The CuPy backend's memory plan against what CuPy's pool really holds.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere. The
plan's formulas on any machine: tests/test_memory_plan.py.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

import anyio  # noqa: E402

from engine import SamplingParams, load_model  # noqa: E402
from engine.backends import cupy_plan  # noqa: E402
from engine.synth import preset_config, write_config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
MIB = 2**20


@pytest.mark.parametrize("kv", ["f16", "f32"])
def test_pool_stays_within_the_memory_plan(tmp_path: Path, kv: str) -> None:
    """Load + a 3,000-token prompt prefilled by Model.generate (512-token chunks, default "auto"
    tiles) + 200 greedy decode steps + two 40-token questions after the prompt (the second
    replayed from a later-chunk graph) on a SmolLM2-shaped model at n_ctx 4096: CuPy's pool grows
    by at most the plan's total, and the plan is at most 25 % above what the pool holds (a plan
    that over-reserves is a defect too). The parts the backend sizes itself match the plan's."""
    p = write_config(tmp_path / "smol.gguf", preset_config("smollm2-135m-q4_1", fast=True, seed=4))
    pool = cp.get_default_memory_pool()
    gc.collect()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    base = pool.total_bytes()
    m = load_model(p, backend="cupy", n_ctx=4096, kv_dtype=kv)
    plan, tf, ops, dec = m.memory_plan, m.transformer, m.transformer.ops, m.decoder
    assert plan.backend == "cupy" and plan.chunk == 512 and ops.prefill_dtype == "auto"
    assert plan.weights == tf.weights_bytes
    assert plan.kv == tf.kv.nbytes
    assert dec is not None
    assert cupy_plan.decode_scratch_bytes(m.spec, dec.n_split) == dec.scratch_bytes, (
        "CupyDecoder's buffers changed: update cupy_plan.decode_scratch_bytes"
    )
    assert plan.decode_scratch >= dec.scratch_bytes

    prompt = np.random.default_rng(2).integers(0, m.spec.n_vocab, 3000).tolist()

    async def run() -> int:
        g = m.generate(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        n = 0
        async for _ in g:
            n += 1
        assert g.prefill_chunk == 512
        return n

    assert anyio.run(run) == 200

    async def question() -> None:  # two questions after the prompt: the second's chunk is captured
        q = np.random.default_rng(len(m.transformer.kv.tokens)).integers(0, m.spec.n_vocab, 40).tolist()
        async for _ in m.generate(prompt + q, SamplingParams(temperature=0, max_tokens=1)):
            pass

    anyio.run(question)
    anyio.run(question)
    cp.cuda.Device().synchronize()
    graphs = ops.prefill_graphs  # the first chunk's graph and the later chunks' hold their own pools
    assert graphs is not None and len(graphs._graphs) == 1 and not graphs.failed
    assert len(graphs._later) == 1 and graphs.later_pool.total_bytes() > 0
    held = pool.total_bytes() - base + graphs.held_bytes
    parts = dict(plan.parts)
    assert ops._scratch is not None and ops._scratch.nbytes == parts["prefill_tiles"]
    assert ops._attn is not None and ops._attn.scores.nbytes == parts["prefill_scores"]
    rows = 0 if ops._attn.k is None else ops._attn.k.nbytes + ops._attn.v.nbytes
    assert rows == parts["prefill_kv_rows"]
    print(
        f"\nkv {kv}: pool held {held / MIB:.1f} MiB, plan {plan.total / MIB:.1f} MiB "
        f"(weights {plan.weights / MIB:.1f}, kv {plan.kv / MIB:.1f}, tables {plan.tables / MIB:.1f}, "
        f"decode {plan.decode_scratch / MIB:.2f}, prefill {plan.prefill_scratch / MIB:.1f}: "
        + ", ".join(f"{k} {v / MIB:.1f}" for k, v in plan.parts)
        + f"); plan/held {plan.total / held:.3f}"
    )
    assert held <= plan.total
    assert plan.total <= 1.25 * held
