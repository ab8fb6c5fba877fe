"""Sampling: logit bias, token mask, greedy, temperature, top-k, top-p, min-p, repetition penalty;
seeded for reproducibility; log-probabilities on request."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import GrammarError


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
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before anything else; -inf bans a token.
    Given as a mapping or pairs; kept sorted by id (a repeated id: its last bias)."""
    logprobs: int | None = None
    """None: off; n (0..20): each token carries its log-probability and the n most likely
    tokens' (`top_logprobs`), from the log-softmax of the biased, masked logits at temperature 1
    (before the repetition penalty and the truncating samplers). The logits row then comes to
    the host every step, on CUDA too (a vocabulary-sized copy), and the token is picked there."""

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
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in 0..{MAX_LOGPROBS}, not {self.logprobs!r}")


MAX_LOGPROBS = 20
"""Most alternatives a token's log-probabilities may list (OpenAI's top_logprobs bound)."""


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """`bias` (a mapping or (id, value) pairs) as sorted pairs; ValueError naming a bad entry."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    out: dict[int, float] = {}
    for entry in items:
        try:
            token, value = entry
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: expected (token id, bias) pairs, got {entry!r}") from None
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            raise ValueError(f"logit_bias: token id must be an integer >= 0, not {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise ValueError(f"logit_bias[{token}]: bias must be a number, not {value!r}")
        v = float(value)
        if math.isnan(v) or v == math.inf:
            raise ValueError(f"logit_bias[{token}]: bias must be finite or -inf, not {v}")
        out[int(token)] = v
    return tuple(sorted(out.items()))


class Sampler:
    """Turns one row of logits into a token id (llama.cpp's order: penalty, top-k, top-p, min-p, temp).

    Before that chain: the logit bias is added and tokens outside the mask (a constrained
    generation's bitmask, `engine.constrain`) become -inf (`adjusted`); greedy takes the argmax
    of what is left.

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

    def __call__(self, logits: np.ndarray, history: Sequence[int] = (), mask: np.ndarray | None = None) -> int:
        u = self.uniform() if self.params.temperature > 0.0 else 0.0
        return self.pick(logits, u, history, mask)

    def adjusted(self, logits: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """The row with the logit bias added and tokens the bitmask `mask` leaves out set to -inf
        (float32; `logits` itself when there is neither)."""
        x = np.asarray(logits, dtype=np.float32).reshape(-1)
        bias = self.params.logit_bias
        if not bias and mask is None:
            return x
        x = x.copy()
        if bias:
            ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
            keep = ids < x.shape[0]
            x[ids[keep]] += np.fromiter((b for _, b in bias), dtype=np.float32, count=len(bias))[keep]
        if mask is not None:
            x[~allowed_tokens(mask, x.shape[0])] = -np.inf
        if not np.isfinite(np.max(x)):
            raise GrammarError("no token is left to pick: the logit_bias bans every token the grammar allows")
        return x

    def pick(self, logits: np.ndarray, u: float, history: Sequence[int] = (), mask: np.ndarray | None = None) -> int:
        """The token for the uniform draw `u` (no randomness of its own); `mask`: the int32
        bitmask of allowed tokens (bit t % 32 of word t // 32), None = all. Greedy with a mask
        tries the unmasked row first: its argmax, when allowed, is the masked row's too."""
        if mask is not None and self.params.temperature <= 0.0:
            token = self.pick_adjusted(self.adjusted(logits), u, history)
            if 0 <= token >> 5 < mask.shape[0] and (int(mask[token >> 5]) >> (token & 31)) & 1:
                return token
        return self.pick_adjusted(self.adjusted(logits, mask), u, history, masked=mask is not None)

    def pick_adjusted(self, x: np.ndarray, u: float, history: Sequence[int] = (), masked: bool = False) -> int:
        """`pick` on a row `adjusted` already gave; `masked`: the chain runs over its finite
        entries only (the same token: -inf ones weigh nothing; and fast when a mask leaves few)."""
        p = self.params
        if p.repeat_penalty != 1.0 and history and p.repeat_last_n:
            seen = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64))
            x = x.copy()
            vals = x[seen]
            x[seen] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        if masked:
            ids = np.flatnonzero(x > -np.inf)  # ascending: ties still go to the smaller id
            return int(ids[self._chain(x[ids], u)])
        return self._chain(x, u)

    def _chain(self, x: np.ndarray, u: float) -> int:
        """Index into `x` that greedy, or top-k, top-p, min-p, temperature and the draw `u` pick."""
        p = self.params
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


def allowed_tokens(mask: np.ndarray, n: int) -> np.ndarray:
    """The int32 bitmask `mask` as booleans for tokens 0..n-1 (tokens past the mask: not allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<i4").view(np.uint8), bitorder="little")
    if bits.shape[0] >= n:
        return bits[:n].view(bool)
    return np.concatenate([bits, np.zeros(n - bits.shape[0], dtype=np.uint8)]).view(bool)


def log_probs(x: np.ndarray, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-softmax of row `x` (temperature 1): `token`'s log-probability and the `n` most likely
    tokens' as (id, logprob), most likely first (equal ones by id)."""
    v = np.asarray(x, dtype=np.float64).reshape(-1)
    top = float(np.max(v))
    lse = top + math.log(float(np.sum(np.exp(v - top))))
    chosen = float(v[token] - lse)
    if n <= 0:
        return chosen, ()
    ids = top_k_ids(v, n)
    ids = ids[np.argsort(-v[ids], kind="stable")]
    return chosen, tuple((int(i), float(v[i] - lse)) for i in ids)


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
