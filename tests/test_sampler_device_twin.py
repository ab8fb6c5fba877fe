"""The on-device sampling algorithm, run by its NumPy twin (`engine.backends.cupy_sample.
reference_sample`, pass for pass what the CUDA kernels do) against the host `Sampler`, and the
host sampler's draw contract (one uniform per sampled token, inverse CDF). No GPU needed."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cupy_sample import pass_schedule, reference_sample, sort_keys, weight_scale
from engine.sampler import Sampler, SamplingParams, top_k_ids
from tests.sampling_cases import PARAMS, check_plan, host_plan, random_history, random_row

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("vocab", [7, 1000, 4097, 49152])
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_twin_matches_host_sampler(vocab: int, name: str) -> None:
    """The twin picks the host's token for the same u, except where u sits within 1e-5 of a
    cumulative boundary (>= 99.5% exact; greedy 100%)."""
    p = PARAMS[name]
    rng = np.random.default_rng(23)
    n = agree = 0
    for _ in range(3):
        x, hist = random_row(rng, vocab), random_history(rng, vocab)
        plan = host_plan(x, p, hist)
        us = rng.random(20)
        check_plan(plan, x, p, hist, us[:3])
        for u in us:
            got, want = reference_sample(x, p, float(u), hist), plan.token(float(u))
            n += 1
            agree += got == want
            assert got == want or plan.ambiguous(float(u)), (name, vocab, float(u), got, want)
    assert agree / n >= (1.0 if p.temperature <= 0 else 0.995)


def test_twin_matches_host_on_a_qwen_sized_vocab() -> None:
    """Vocab 151936, full-vocabulary softmax (top_k 0, top_p 1, min_p 0) and the defaults:
    the same token as the host for 20 draws each."""
    rng = np.random.default_rng(41)
    x, hist = random_row(rng, 151936), random_history(rng, 151936)
    for p in (PARAMS["temperature"], PARAMS["defaults"], PARAMS["all"]):
        plan = host_plan(x, p, hist)
        for u in rng.random(20):
            got = reference_sample(x, p, float(u), hist)
            assert got == plan.token(float(u)) or plan.ambiguous(float(u))


def test_ties_and_negative_zero_order_by_id() -> None:
    """Equal logits (and -0 vs +0) rank by id ascending, in the top-k cut too, on host and twin."""
    rng = np.random.default_rng(52)
    for _ in range(20):
        vocab = int(rng.integers(5, 3000))
        x = (rng.integers(-3, 4, vocab) * 0.5).astype(np.float32)
        x[rng.integers(0, vocab, 3)] = -0.0
        for p in (
            SamplingParams(temperature=1.0, top_k=int(rng.integers(1, vocab)), top_p=0.7, min_p=0.0),
            SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.2),
            PARAMS["greedy_penalty"],
        ):
            hist = random_history(rng, vocab, 10)
            plan = host_plan(x, p, hist)
            if plan.top_p_margin < 1e-6:
                continue  # tied weights sum exactly to top_p (7 of 10 equal ones): either cut is right
            for u in rng.random(10):
                assert reference_sample(x, p, float(u), hist) == plan.token(float(u))
    x = np.array([1.0, 2.0, 2.0, 2.0, 0.5], np.float32)
    assert top_k_ids(x, 2).tolist() == [1, 2]
    assert Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)).pick(x, 0.99) == 2


def test_keys_order_like_logits_then_ids() -> None:
    """Ascending sort keys = logits descending, then ids ascending (inf, -inf, zeros included;
    -0 is made +0 before keys are formed, as `smp_prep` does)."""
    x = np.array([0.5, -np.inf, 3.0, -0.0, 0.0, np.inf, -2.5, 3.0, 1e-30, -1e-30], np.float32)
    x[x == 0] = 0.0
    got = np.argsort(sort_keys(x))
    want = np.lexsort((np.arange(x.size), -x.astype(np.float64)))
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("vocab", [2, 7, 2048, 2049, 151936, 262144])
def test_pass_schedule_covers_every_key_bit(vocab: int) -> None:
    """The radix digits tile the logit's 32 bits and the id's bits, top down, <= 11 bits each;
    a whole vocabulary of top weights fits in 62 bits."""
    sched = pass_schedule(vocab)
    bits = [b for shift, n in sched for b in range(shift + n - 1, shift - 1, -1)]
    id_bits = max(1, (vocab - 1).bit_length())
    assert bits == list(range(63, 31, -1)) + list(range(id_bits - 1, -1, -1))
    assert all(n <= 11 for _, n in sched)
    assert vocab * weight_scale(vocab) <= 2.0**62


def test_sampler_draws_one_uniform_per_token_like_choice() -> None:
    """`Sampler` consumes one `rng.random()` per sampled token (none for greedy) and picks by
    inverse CDF: the tokens `Generator.choice` gave before, for the same seed."""
    rng = np.random.default_rng(0)
    rows = [random_row(rng, 300) for _ in range(30)]
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=7)
    s, ref = Sampler(p), np.random.default_rng(7)
    for x in rows:
        plan = host_plan(x, p)
        w = np.diff(np.concatenate([[0.0], plan.cdf]))
        assert s(x) == int(plan.ids[ref.choice(len(plan.ids), p=w / w.sum())])
    g = Sampler(SamplingParams(temperature=0, seed=7))
    for x in rows:
        g(x)
    assert g.uniform() == np.random.default_rng(7).random()
