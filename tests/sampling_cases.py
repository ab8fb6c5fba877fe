"""Shared by the sampler tests: parameter combinations, random logits rows, and the host
sampler's inverse CDF laid out once per row so many uniform draws are cheap to check, with how
close each draw (and top_p) lies to a cumulative boundary."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.sampler import Sampler, SamplingParams, top_k_ids

PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy_penalty": SamplingParams(temperature=0.0, repeat_penalty=1.3),
    "temperature": SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
    "hot": SamplingParams(temperature=1.7, top_k=0, top_p=1.0, min_p=0.0),
    "top_k": SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0),
    "top_k_big": SamplingParams(temperature=1.0, top_k=3000, top_p=1.0, min_p=0.0),
    "top_k1": SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0),
    "top_p": SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
    "min_p": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    "penalty": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.5, repeat_last_n=32),
    "defaults": SamplingParams(),
    "all": SamplingParams(temperature=0.6, top_k=500, top_p=0.8, min_p=0.02, repeat_penalty=1.2),
}


def random_row(rng: np.random.Generator, vocab: int) -> np.ndarray:
    """Logits like a model's: a normal bulk, a spread that varies, a few strong candidates."""
    x = rng.standard_normal(vocab) * rng.uniform(0.5, 3.0)
    x[rng.integers(0, vocab, 5)] += rng.uniform(2, 8, 5)
    return x.astype(np.float32)


def random_history(rng: np.random.Generator, vocab: int, n: int = 80) -> list[int]:
    """Recent ids with repeats."""
    h = rng.integers(0, vocab, n)
    h[n // 2 :] = h[: n - n // 2]
    return [int(t) for t in h]


@dataclass
class HostPlan:
    """`Sampler.pick` for one row, up to the draw: kept ids in order and their CDF."""

    ids: np.ndarray
    cdf: np.ndarray
    top_p_margin: float
    """Distance of top_p to the nearest cumulative probability (inf when top-p is off)."""
    min_p_margin: float
    """Relative distance of min_p to the nearest exp(x - max) (inf when min-p is off)."""
    greedy: bool

    def token(self, u: float) -> int:
        return int(self.ids[min(int(np.searchsorted(self.cdf, u, side="right")), len(self.ids) - 1)])

    def ambiguous(self, u: float, tol: float = 1e-5) -> bool:
        """Whether host and device may rightly differ: u (or top_p, min_p) at a boundary."""
        if self.greedy:
            return False
        i = min(int(np.searchsorted(self.cdf, u, side="right")), len(self.ids) - 1)
        near = abs(self.cdf[i] - u) < tol or (i > 0 and abs(self.cdf[i - 1] - u) < tol)
        return bool(near or self.top_p_margin < 1e-6 or self.min_p_margin < 1e-9)


def host_plan(logits: np.ndarray, p: SamplingParams, history: Sequence[int] = ()) -> HostPlan:
    """The steps of `Sampler.pick` before the draw (checked against it by the tests)."""
    x = np.asarray(logits, dtype=np.float32).copy()
    if p.repeat_penalty != 1.0 and history and p.repeat_last_n:
        seen = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64))
        vals = x[seen]
        x[seen] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    if p.temperature <= 0:
        return HostPlan(np.array([int(np.argmax(x))]), np.ones(1), np.inf, np.inf, True)
    idx = top_k_ids(x, p.top_k)
    order = np.argsort(-x[idx], kind="stable")
    idx, vals = idx[order], x[idx][order].astype(np.float64)
    e = np.exp(vals - vals[0])
    probs = e / e.sum()
    keep, tp_margin, mp_margin = len(idx), np.inf, np.inf
    if p.top_p < 1.0:
        cs = np.cumsum(probs)
        keep = min(keep, int(np.searchsorted(cs, p.top_p) + 1))
        tp_margin = float(np.min(np.abs(cs - p.top_p)))
    if p.min_p > 0.0:
        keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        mp_margin = float(np.min(np.abs(e / p.min_p - 1.0)))
    w = np.exp((vals[:keep] - vals[0]) / p.temperature)
    w /= w.sum()
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return HostPlan(idx[:keep], cdf, tp_margin, mp_margin, False)


def check_plan(
    plan: HostPlan, logits: np.ndarray, p: SamplingParams, history: Sequence[int], us: Sequence[float]
) -> None:
    """The plan picks what `Sampler.pick` picks."""
    s = Sampler(p)
    for u in us:
        assert plan.token(u) == s.pick(logits, u, history)
