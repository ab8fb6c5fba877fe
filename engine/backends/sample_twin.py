"""The on-device sampling algorithm in NumPy (`reference_sample`), pass for pass as the CUDA kernels
(`engine.kernels.sample_src`) run it: digits, integer weights, targets; and what both share (the
radix schedule, the weight scale, which stages run, the repetition window). The device sampler is
`engine.backends.cupy_sample.DeviceSampler`; this module needs no CuPy, so the algorithm is tested
without a GPU (`tests/test_sampler_device_twin.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..kernels import sample_src as ks
from ..sampler import Sampler, SamplingParams

VALUE_DIGITS = ((53, 11), (42, 11), (32, 10))
"""(shift, bits) of the radix digits over the logit half of the key (bits 63..32)."""
ALL = (1 << 64) - 1
"""A bound that keeps every token."""


def pass_schedule(vocab: int) -> list[tuple[int, int]]:
    """(shift, bits) of every radix digit of a selection: the logit's 32 bits, then the id's."""
    out = list(VALUE_DIGITS)
    rest = max(1, (vocab - 1).bit_length())
    while rest > 0:
        n = min(ks.BITS, rest)
        rest -= n
        out.append((rest, n))
    return out


def weight_scale(vocab: int) -> float:
    """Integer weights are round(w * scale), w <= 1: a whole vocabulary sums to < 2^62."""
    return float(2.0 ** (62 - max(1, (vocab - 1).bit_length())))


def flags_of(params: SamplingParams, vocab: int, n_recent: int, masked: bool = False) -> int:
    """Which stages run (bits `F_*` of `engine.kernels.sample_src`)."""
    f = ks.F_PEN if params.repeat_penalty != 1.0 and n_recent > 0 else 0
    if masked:
        f |= ks.F_MASK
    if params.logit_bias:
        f |= ks.F_BIAS
    if params.temperature > 0.0:
        f |= ks.F_SAMPLE
        if 0 < params.top_k < vocab:
            f |= ks.F_TOPK
        if params.top_p < 1.0:
            f |= ks.F_TOPP
        if params.min_p > 0.0:
            f |= ks.F_MINP
    return f


def recent_window(params: SamplingParams, history: Sequence[int]) -> Sequence[int]:
    """The ids the repetition penalty looks at (as `Sampler.pick` slices them)."""
    if params.repeat_penalty == 1.0 or not history or not params.repeat_last_n:
        return ()
    return history[-params.repeat_last_n :]


# --- the NumPy twin -------------------------------------------------------------------------------
def sort_keys(x: np.ndarray) -> np.ndarray:
    """uint64 keys (desc_bits(x) << 32 | id): ascending keys = logits descending, then ids."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    b = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000))
    return ((~b).astype(np.uint64) << np.uint64(32)) | np.arange(x.shape[0], dtype=np.uint64)


def _hist(digits: np.ndarray, w: np.ndarray, nb: int) -> np.ndarray:
    """Exact uint64 sums of w per digit (w < 2^46: two float64 bincounts of 23-bit halves)."""
    lo = np.bincount(digits, weights=(w & np.uint64(0x7FFFFF)).astype(np.float64), minlength=nb)
    hi = np.bincount(digits, weights=(w >> np.uint64(23)).astype(np.float64), minlength=nb)
    return (hi.astype(np.uint64) << np.uint64(23)) + lo.astype(np.uint64)


def _select(keys: np.ndarray, w: np.ndarray, target_of: Any, schedule: list[tuple[int, int]]) -> int:
    """`smp_select` over its digits: the key of the first member (in key order) whose inclusive
    cumulative weight exceeds the target (`target_of(total)`); ALL when none does."""
    prefix, cum, target = 0, 0, 0
    for shift, nbits in schedule:
        hi = shift + nbits
        sel = np.ones(keys.shape[0], bool) if hi >= 64 else (keys >> np.uint64(hi)) == np.uint64(prefix >> hi)
        digits = ((keys[sel] >> np.uint64(shift)) & np.uint64((1 << nbits) - 1)).astype(np.int64)
        hist = [int(h) for h in _hist(digits, w[sel], 1 << nbits)]
        if hi >= 64:
            target = target_of(sum(hist))
        rem, acc = target - cum, 0
        for b, h in enumerate(hist):
            if acc + h > rem:
                prefix |= b << shift
                cum += acc
                break
            acc += h
        else:
            return ALL
    return prefix


def _weights(d: np.ndarray, scale: float) -> np.ndarray:
    return np.rint(np.exp(d) * scale).astype(np.uint64)


def reference_sample(
    logits: np.ndarray,
    params: SamplingParams,
    u: float,
    history: Sequence[int] = (),
    mask: np.ndarray | None = None,
) -> int:
    """The device algorithm in NumPy (see the module doc): the token for the uniform draw `u`
    (`mask`: the int32 bitmask of allowed tokens, as `Sampler.pick` takes it)."""
    p = params
    x = np.array(Sampler(p).adjusted(logits, mask), dtype=np.float32).reshape(-1)
    vocab = x.shape[0]
    window = recent_window(p, history)
    if window:
        ids = np.asarray(window, dtype=np.int64)
        seen = np.zeros(vocab, bool)
        seen[ids[(ids >= 0) & (ids < vocab)]] = True
        pen = np.float32(p.repeat_penalty)
        x[seen] = np.where(x[seen] > 0, x[seen] / pen, x[seen] * pen)
    x[x == 0] = 0.0  # -0 -> +0
    arg = int(np.argmax(x))
    f = flags_of(p, vocab, len(window))
    if not f & ks.F_SAMPLE:
        return arg
    keys, sched, scale = sort_keys(x), pass_schedule(vocab), weight_scale(vocab)
    d = x.astype(np.float64) - np.float64(x[arg])
    b0 = b1 = ALL
    if f & ks.F_TOPK:
        b0 = _select(keys, np.ones(vocab, np.uint64), lambda tot: p.top_k - 1, sched)
    in_k = keys <= np.uint64(b0)
    if f & ks.F_TOPP:
        e = np.where(in_k, _weights(d, scale), np.uint64(0))

        def top_p_target(tot: int) -> int:
            c = int(np.ceil(p.top_p * float(tot)))
            return c - 1 if c else 0

        b1 = _select(keys, e, top_p_target, sched)
    kept = in_k & (keys <= np.uint64(b1))
    if f & ks.F_MINP:
        kept &= ~(np.exp(d) < p.min_p)
    w = np.where(kept, _weights(d / p.temperature, scale), np.uint64(0))

    def pick_target(tot: int) -> int:
        t = int(np.floor(u * float(tot)))
        return tot - 1 if t >= tot and tot else t

    key = _select(keys, w, pick_target, sched)
    return arg if key == ALL else int(key & 0xFFFFFFFF)
