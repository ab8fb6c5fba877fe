"""Sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty; seeded for reproducibility."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token and when to stop."""

    max_tokens: int = 256
    """Most tokens to generate."""
    temperature: float = 0.8
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 40
    """Keep the k most likely tokens (0 = all)."""
    top_p: float = 0.95
    """Keep the smallest set whose probability reaches p (1.0 = all)."""
    min_p: float = 0.05
    """Drop tokens less likely than min_p x the most likely one (0 = off)."""
    repeat_penalty: float = 1.0
    """Penalise tokens seen in the last `repeat_last_n` tokens (1.0 = off)."""
    repeat_last_n: int = 64
    """Window of the repetition penalty."""
    seed: int | None = None
    """Random seed; the same seed gives the same tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end the generation (not included in the output)."""
    ignore_eos: bool = False
    """Keep going past end-of-generation tokens."""

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.repeat_penalty <= 0:
            raise ValueError("repeat_penalty must be > 0")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))


class Sampler:
    """Turns one row of logits into a token id (llama.cpp's order: penalty, top-k, top-p, min-p, temp).

    Order of the candidates: logit descending, then id ascending (also which of equal logits
    make the top-k). A sampled token costs one uniform draw `u` from the seeded generator
    (`uniform`), turned into a token by inverse CDF over the kept weights (`pick`) - the same
    draw `numpy.random.Generator.choice` made before, and what the device sampler
    (`engine.backends.cupy_sample`) is given, so host and device follow one seed alike.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def uniform(self) -> float:
        """The next uniform draw in [0, 1) (one per sampled token; none for greedy)."""
        return float(self.rng.random())

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        u = self.uniform() if self.params.temperature > 0.0 else 0.0
        return self.pick(logits, u, history)

    def pick(self, logits: np.ndarray, u: float, history: Sequence[int] = ()) -> int:
        """The token for the uniform draw `u` (no randomness of its own)."""
        p = self.params
        x = np.asarray(logits, dtype=np.float32).reshape(-1)
        if p.repeat_penalty != 1.0 and history and p.repeat_last_n:
            seen = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64))
            x = x.copy()
            vals = x[seen]
            x[seen] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        if p.temperature <= 0.0:
            return int(np.argmax(x))
        idx = top_k_ids(x, p.top_k)
        vals = x[idx]
        order = np.argsort(-vals, kind="stable")  # idx ascends within equal logits: ties by id
        idx, vals = idx[order], vals[order].astype(np.float64)
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        keep = len(idx)
        if p.top_p < 1.0:
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p) + 1))
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        idx, vals = idx[:keep], vals[:keep]
        scaled = (vals - vals[0]) / p.temperature
        w = np.exp(scaled)
        w /= w.sum()
        cdf = np.cumsum(w)
        cdf /= cdf[-1]
        return int(idx[min(int(np.searchsorted(cdf, u, side="right")), len(idx) - 1)])


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest values of x (all for k = 0 or k >= len), ascending by id within equal
    values; of values equal to the k-th, the smallest ids."""
    n = x.shape[0]
    if not k or k >= n:
        return np.arange(n)
    kth = np.partition(x, n - k)[n - k]
    above = np.flatnonzero(x > kth)
    ties = np.flatnonzero(x == kth)[: k - above.size]
    return np.concatenate([above, ties])
