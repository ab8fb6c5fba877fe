"""The host sampler's logit bias, token mask and log-probabilities (no model needed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from engine import GrammarError
from engine.backends.cupy_sample import reference_sample
from engine.sampler import Sampler, SamplingParams, allowed_tokens, log_probs
from tests.sampling_cases import PARAMS, host_plan, random_history, random_row

pytestmark = pytest.mark.timeout(60)


def _mask_of(allowed: np.ndarray) -> np.ndarray:
    """The int32 bitmask (bit t % 32 of word t // 32) of a boolean row."""
    padded = np.zeros(-(-allowed.size // 32) * 32, dtype=bool)
    padded[: allowed.size] = allowed
    return np.packbits(padded, bitorder="little").view("<i4").copy()


def test_bitmask_layout_is_llguidance_s() -> None:
    """`allowed_tokens` reads a bitmask as llguidance's own NumPy helper applies it."""
    rng = np.random.default_rng(3)
    for n in (1, 31, 32, 33, 1000, 49152):
        want = rng.random(n) < 0.3
        mask = _mask_of(want)
        row = np.zeros((1, n), dtype=np.float32)
        apply_token_bitmask_inplace(row, mask[None, :])
        assert np.array_equal(allowed_tokens(mask, n), want) and np.array_equal(np.isfinite(row[0]), want)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repeat_penalty=1.3),
        SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1),
        SamplingParams(temperature=0.8, seed=2),
    ],
)
def test_mask_keeps_the_pick_inside_the_allowed_tokens(params: SamplingParams) -> None:
    """Greedy and sampled picks always land on allowed tokens, even when the best logits are masked."""
    rng = np.random.default_rng(5)
    s = Sampler(params)
    for _ in range(50):
        x = rng.standard_normal(500).astype(np.float32) * 3
        allowed = rng.random(500) < 0.05
        allowed[int(np.argmin(x))] = True
        mask = _mask_of(allowed)
        assert allowed[s(x, [1, 2, 3], mask)]
    x = np.array([5.0, 1.0, 4.0, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0))(x, (), _mask_of(np.array([False, True, True, True]))) == 2


def test_logit_bias_shifts_and_bans() -> None:
    """A positive bias lifts a token to the top; -inf bans the argmax for greedy and sampling."""
    x = np.array([3.0, 2.0, 1.0, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0, logit_bias={3: 10.0}))(x) == 3
    banned = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=4, logit_bias={0: -math.inf})
    s = Sampler(banned)
    assert 0 not in {s(x) for _ in range(200)}
    assert Sampler(SamplingParams(temperature=0, logit_bias=[(0, -math.inf)]))(x) == 1


def test_bias_and_mask_leaving_nothing_is_a_grammar_error() -> None:
    """A bias that bans every token the mask allows raises GrammarError instead of picking one."""
    s = Sampler(SamplingParams(temperature=0, logit_bias={1: -math.inf}))
    with pytest.raises(GrammarError, match="bans every token"):
        s(np.zeros(4, dtype=np.float32), (), _mask_of(np.array([False, True, False, False])))


def test_log_probs_are_a_full_vocabulary_log_softmax() -> None:
    """exp of the log-probabilities over the whole row sums to 1; the top n are sorted, ties by id."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal(4097).astype(np.float32) * 4
    x[[10, 20]] = x.max() + 1.0
    full = np.array([log_probs(x, t, 0)[0] for t in range(x.size)])
    assert abs(np.exp(full).sum() - 1.0) < 1e-9
    lp, top = log_probs(x, 20, 5)
    assert lp == pytest.approx(full[20]) and [t for t, _ in top][:2] == [10, 20]
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True) and len(top) == 5
    masked = np.where(np.arange(x.size) % 2 == 0, x, -np.inf)
    assert abs(np.exp([log_probs(masked, t, 0)[0] for t in range(0, x.size, 2)]).sum() - 1.0) < 1e-9


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {-1: 1.0}}, "token id"),
        ({"logit_bias": {"5": 1.0}}, "token id"),
        ({"logit_bias": {5: math.nan}}, "finite or -inf"),
        ({"logit_bias": {5: math.inf}}, "finite or -inf"),
        ({"logit_bias": {5: "x"}}, "must be a number"),
        ({"logit_bias": [5]}, "pairs"),
    ],
)
def test_bad_logprobs_and_logit_bias_are_refused(kwargs: dict[str, object], message: str) -> None:
    """SamplingParams refuses logprobs outside 0..20 and logit_bias entries that are not (id >= 0, number)."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_logit_bias_is_kept_sorted_with_the_last_value_of_an_id() -> None:
    """A mapping or pairs become sorted (id, bias) pairs; a repeated id keeps its last bias."""
    assert SamplingParams(logit_bias=[(7, 1), (2, -1.5), (7, 3)]).logit_bias == ((2, -1.5), (7, 3.0))  # type: ignore[arg-type]
    assert SamplingParams(logit_bias={3: -math.inf}).logit_bias == ((3, -math.inf),)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_device_twin_applies_mask_and_bias_as_the_host(name: str) -> None:
    """The NumPy twin of the device sampler, given a mask and a logit bias, picks the host's token
    for the same u (except u within 1e-5 of a cumulative boundary), never a masked or banned one."""
    rng = np.random.default_rng(31)
    vocab = 4097
    for density in (0.3, 0.002):
        x, hist = random_row(rng, vocab), random_history(rng, vocab)
        allowed = rng.random(vocab) < density
        allowed[rng.integers(0, vocab, 3)] = True
        best = int(np.argmax(np.where(allowed, x, -np.inf)))
        p = SamplingParams(
            **{**PARAMS[name].__dict__, "logit_bias": ((best, -math.inf), (int(rng.integers(vocab)), 2.0))}
        )
        mask = _mask_of(allowed)
        plan = host_plan(Sampler(p).adjusted(x, mask), p, hist)
        for u in rng.random(10):
            got = reference_sample(x, p, float(u), hist, mask)
            assert allowed[got] and got != best
            assert got == plan.token(float(u)) or plan.ambiguous(float(u)), (float(u), got)
