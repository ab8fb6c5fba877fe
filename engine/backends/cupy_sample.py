"""Sampling on the device: a logits row on the GPU in, one token id (4 bytes) back to the host.

`DeviceSampler.sample(logits_dev, params, u, history, mask=...)` picks the token
`engine.sampler.Sampler` picks for the same uniform draw `u` (`Sampler.pick`): logit bias and
token mask, repetition penalty, top-k, top-p, min-p, temperature, inverse CDF; temperature 0 is
the argmax after the penalty. Kernels and the algorithm: `engine.kernels.sample_src` (no sort:
radix selections over exact integer weights).

A constrained generation's mask (`engine.constrain.Constraint`) is filled on the host into a
pinned buffer after the step's forward pass is queued - while the GPU runs it - and copied to
the device on the same stream (n_vocab / 8 bytes); the logit bias travels as (id, value) pairs.
Without either, nothing changes: no extra launch, no extra copy.

`reference_sample` (`engine.backends.sample_twin`, re-exported here) is the same algorithm in
NumPy, pass for pass (digits, integer weights, targets), so the algorithm is tested without a GPU
(`tests/test_sampler_device_twin.py`); the device is tested against it and against `Sampler` in
`tests/test_cupy_sample.py`.

`queue` is the chained form (`engine.backends.cupy_chain`): the token stays on the device, for
the next decode step to read; each queued sample uploads its parameters from its own pinned slot.

Agreement with `Sampler.pick`: the same order (logit descending, id ascending) and cuts; the
weights are float64 exponentials rounded to integers (`weight_scale`: 2^44 for a 151936 vocab),
so cumulative sums differ from the host's float64 ones by < 1e-8 of the total. A token differs
only where `u` (or top_p) lies that close to a cumulative boundary; weights below 1/scale of the
largest count as 0 (never picked, as on the host with probability < 1e-8 in all).

CuPy is imported inside `DeviceSampler` only: this module loads without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ..constrain import mask_words
from ..errors import GrammarError
from ..kernels import sample_src as ks
from ..sampler import SamplingParams
from .sample_twin import (
    ALL,
    VALUE_DIGITS,
    flags_of,
    pass_schedule,
    recent_window,
    reference_sample,
    sort_keys,
    weight_scale,
)

log = logging.getLogger(__name__)

__all__ = [
    "ALL",
    "VALUE_DIGITS",
    "DeviceSampler",
    "flags_of",
    "pass_schedule",
    "recent_window",
    "reference_sample",
    "sort_keys",
    "weight_scale",
]

MAX_GRAPHS = 16
"""Captured graphs kept (one per logits buffer and set of active stages)."""
BIAS_SLOTS = 1024
"""Logit-bias entries the device buffers hold at first (more: they grow, and graphs are recaptured)."""
PARAM_SLOTS = 4
"""Pinned parameter buffers of queued samples (`queue`): a chained decode keeps up to two steps
queued, each uploading its own draw from its own slot while the host fills the next."""


# --- the device sampler ---------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _module() -> Any:
    import cupy as cp

    return cp.RawModule(code=ks.source(), options=("--std=c++17",))


class DeviceSampler:
    """Preallocated buffers + the sampling kernels for one vocabulary size; `sample` launches on a
    given stream (a CUDA graph per logits buffer and set of active stages) and reads back 4 bytes."""

    def __init__(self, vocab: int, max_history: int = 4096, use_graph: bool = True) -> None:
        import cupy as cp

        self._cp = cp
        self.vocab = int(vocab)
        self.max_history = max(1, int(max_history))
        self.blocks = -(-self.vocab // ks.CHUNK)
        self.schedule = pass_schedule(self.vocab)
        self.scale = weight_scale(self.vocab)
        self.use_graph = use_graph
        mod = _module()
        self._adjust = mod.get_function("smp_adjust")
        self._prep = mod.get_function("smp_prep")
        self._select = mod.get_function("smp_select")
        # --- buffers (allocated once) ---------------------------------------------------------
        pbytes = ks.PD_N * 8 + ks.PI_N * 4
        self.params_dev = cp.zeros(pbytes, dtype=cp.uint8)
        self.recent_dev = cp.zeros(self.max_history, dtype=cp.int32)
        self.xw = cp.zeros(self.vocab, dtype=cp.float32)  # the penalised row
        self.state = cp.zeros(ks.STATE_BYTES, dtype=cp.uint8)
        self.bv = cp.zeros(self.blocks, dtype=cp.float32)
        self.bi = cp.zeros(self.blocks, dtype=cp.int32)
        self.ghist = cp.zeros(1 << ks.BITS, dtype=cp.uint64)
        self.counter = cp.zeros(1, dtype=cp.int32)
        self.out = cp.zeros(1, dtype=cp.int32)
        self.words = mask_words(self.vocab)
        self.xa = cp.zeros(self.vocab, dtype=cp.float32)  # the biased, masked row
        self.mask_dev = cp.zeros(self.words, dtype=cp.int32)
        self._mask_mem = cp.cuda.alloc_pinned_memory(self.words * 4)
        self.mask_host = np.frombuffer(self._mask_mem, np.int32, self.words)
        self._bias_cap = 0
        self._bias_sent: tuple[tuple[int, float], ...] = ()
        self._grow_bias(BIAS_SLOTS)
        self._params_mem = cp.cuda.alloc_pinned_memory(pbytes * (1 + PARAM_SLOTS))
        views = [
            (
                np.frombuffer(self._params_mem, np.float64, ks.PD_N, offset=j * pbytes),
                np.frombuffer(self._params_mem, np.int32, ks.PI_N, offset=j * pbytes + ks.PD_N * 8),
            )
            for j in range(1 + PARAM_SLOTS)
        ]
        self.pd, self.pi = views[0]
        self._slots = views[1:]
        """Parameter buffers of `queue` (slot j: one queued sample's)."""
        self._recent_mem = cp.cuda.alloc_pinned_memory(self.max_history * 4)
        self.recent_host = np.frombuffer(self._recent_mem, np.int32, self.max_history)
        self._out_mem = cp.cuda.alloc_pinned_memory(4)
        self.out_host = np.frombuffer(self._out_mem, np.int32, 1)
        for pd, pi in views:
            pd[ks.PD_SCALE] = self.scale
            pi[ks.PI_VOCAB] = self.vocab
        self.nbytes = int(sum(a.nbytes for a in vars(self).values() if isinstance(a, cp.ndarray)))
        """Bytes of the device buffers above (the bias slots grow past BIAS_SLOTS on demand)."""
        self._capture_stream = cp.cuda.Stream(non_blocking=True)
        self._graphs: dict[tuple[int, int], Any] = {}
        self.launches = 0
        """Kernel sequences run (graph replays or eager), for tests and benchmarks."""

    def _grow_bias(self, n: int) -> None:
        """Room for `n` logit-bias entries on the device and in pinned host memory."""
        cp = self._cp
        cap = max(n, 2 * self._bias_cap)
        self.bias_ids_dev = cp.zeros(cap, dtype=cp.int32)
        self.bias_vals_dev = cp.zeros(cap, dtype=cp.float32)
        self._bias_mem = cp.cuda.alloc_pinned_memory(cap * 8)
        self.bias_ids_host = np.frombuffer(self._bias_mem, np.int32, cap)
        self.bias_vals_host = np.frombuffer(self._bias_mem, np.float32, cap, offset=cap * 4)
        self._bias_cap = cap
        self._bias_sent = ()
        self._graphs = {}  # captured with the old buffers

    def _launches(self, logits_dev: Any, flags: int) -> list[tuple[Any, tuple[Any, ...]]]:
        return sample_launches((self._adjust, self._prep, self._select), self, logits_dev, flags)

    def _run(self, logits_dev: Any, flags: int, stream: Any) -> None:
        key = (int(logits_dev.data.ptr), flags & (ks.F_TOPK | ks.F_TOPP | ks.F_SAMPLE | ks.F_MASK | ks.F_BIAS))
        graph = self._graphs.get(key)
        if graph is not None:
            graph.launch(stream)
            return
        launches = self._launches(logits_dev, key[1])
        with stream:
            for fn, args in launches:
                fn(*args)
        if key not in self._graphs:  # first use ran eagerly: capture for next time
            if len(self._graphs) >= MAX_GRAPHS:  # many logits buffers (tests): forget the oldest
                del self._graphs[next(iter(self._graphs))]
            self._graphs[key] = self._capture(launches) if self.use_graph else None

    def _capture(self, launches: list[tuple[Any, tuple[Any, ...]]]) -> Any:
        s = self._capture_stream
        try:
            with s:
                s.begin_capture()
                try:
                    for fn, args in launches:
                        fn(*args)
                finally:
                    graph = s.end_capture()
            return graph
        except Exception as exc:  # no graph support: eager launches
            log.warning(
                "device sampler: CUDA graph capture failed (%s: %s); launching eagerly", type(exc).__name__, exc
            )
            return None

    def sample(
        self,
        logits_dev: Any,
        params: SamplingParams,
        u: float,
        history: Sequence[int] = (),
        stream: Any = None,
        mask: Any = None,
    ) -> int:
        """The token `Sampler.pick(logits, u, history, mask)` gives for the float32 row
        `logits_dev` [vocab] on the device; queued on `stream` (default: the current one) after
        what is there. `mask`: an int32 bitmask on the host, or an object whose `fill(out)`
        writes one (a `Constraint`: filled here, while the queued work runs on the device)."""
        cp = self._cp
        if logits_dev.size != self.vocab or logits_dev.dtype != cp.float32:
            raise ValueError(f"logits must be float32 [{self.vocab}], got {logits_dev.dtype} {logits_dev.shape}")
        if not 0.0 <= u < 1.0:
            raise ValueError(f"u must be in [0, 1), got {u}")
        stream = cp.cuda.get_current_stream() if stream is None else stream
        window = recent_window(params, history)
        n = len(window)
        if n > self.max_history:
            raise ValueError(f"repetition window of {n} ids exceeds max_history {self.max_history}")
        flags = flags_of(params, self.vocab, n, mask is not None)
        pd, pi = self.pd, self.pi
        _fill(pd, pi, params, u, n, flags)
        h2d, d2h = cp.cuda.runtime.memcpyHostToDevice, cp.cuda.runtime.memcpyDeviceToHost
        if mask is not None:
            self._upload_mask(mask, stream)
            if flags & ks.F_SAMPLE:
                self._narrow_top_k(params, flags)
        if params.logit_bias and params.logit_bias != self._bias_sent:
            self._upload_bias(params.logit_bias, stream)
        cp.cuda.runtime.memcpyAsync(
            self.params_dev.data.ptr, self.pd.ctypes.data, self.params_dev.nbytes, h2d, stream.ptr
        )
        if n:
            self.recent_host[:n] = window
            cp.cuda.runtime.memcpyAsync(self.recent_dev.data.ptr, self.recent_host.ctypes.data, 4 * n, h2d, stream.ptr)
        self._run(logits_dev, int(pi[ks.PI_FLAGS]), stream)
        self.launches += 1
        cp.cuda.runtime.memcpyAsync(self.out_host.ctypes.data, self.out.data.ptr, 4, d2h, stream.ptr)
        stream.synchronize()
        token = int(self.out_host[0])
        if mask is not None and not (int(self.mask_host[token >> 5]) >> (token & 31)) & 1:
            raise GrammarError("no token is left to pick: the logit_bias bans every token the grammar allows")
        return token

    # --- queued samples (a decode chained on the device: `engine.backends.cupy_chain`) ---------
    def prepare(self, params: SamplingParams, window: Sequence[int], stream: Any) -> None:
        """Before a run of `queue` calls: the logit bias (when it changed) and the repetition
        window `window` (ids, oldest first; the chain's ring continues it) to the device, on
        `stream`. Nothing may be queued that still reads the pinned recent-ids buffer."""
        cp = self._cp
        if len(window) > self.max_history:
            raise ValueError(f"repetition window of {len(window)} ids exceeds max_history {self.max_history}")
        if params.logit_bias and params.logit_bias != self._bias_sent:
            self._upload_bias(params.logit_bias, stream)
        if window:
            n = len(window)
            self.recent_host[:n] = window
            cp.cuda.runtime.memcpyAsync(
                self.recent_dev.data.ptr,
                self.recent_host.ctypes.data,
                4 * n,
                cp.cuda.runtime.memcpyHostToDevice,
                stream.ptr,
            )

    def queue(self, logits_dev: Any, params: SamplingParams, u: float, n_recent: int, stream: Any, slot: int) -> None:
        """Queue the sample of `logits_dev` on `stream` with the draw `u` and the first `n_recent`
        ids of the device's recent-ids buffer as the repetition window; the token lands in `out`
        on the device (nothing comes back, nothing waits). `slot` (0..PARAM_SLOTS-1) is the pinned
        parameter buffer: one not used by a sample still queued."""
        cp = self._cp
        if not 0.0 <= u < 1.0:
            raise ValueError(f"u must be in [0, 1), got {u}")
        flags = flags_of(params, self.vocab, n_recent)
        pd, pi = self._slots[slot]
        _fill(pd, pi, params, u, n_recent, flags)
        cp.cuda.runtime.memcpyAsync(
            self.params_dev.data.ptr,
            pd.ctypes.data,
            self.params_dev.nbytes,
            cp.cuda.runtime.memcpyHostToDevice,
            stream.ptr,
        )
        self._run(logits_dev, flags, stream)
        self.launches += 1

    def _narrow_top_k(self, params: SamplingParams, flags: int) -> None:
        """Top-k over the allowed tokens only: with fewer allowed than k (a grammar usually allows
        a handful), k becomes their count, so the selection does not sift through the masked
        rest's equal -inf values. The token is the same: what it drops has weight exactly 0."""
        allowed = int(np.unpackbits(self.mask_host.view(np.uint8)).sum())
        k = params.top_k if 0 < params.top_k < self.vocab else self.vocab
        if 0 < allowed < k:
            self.pi[ks.PI_TOPK] = allowed
            self.pi[ks.PI_FLAGS] = flags | ks.F_TOPK

    def _upload_mask(self, mask: Any, stream: Any) -> None:
        """The mask into the pinned buffer (computed now by a `Constraint`), then to the device."""
        cp = self._cp
        if isinstance(mask, np.ndarray):
            if mask.size < self.words:
                raise ValueError(f"the mask must have {self.words} int32 words, got {mask.size}")
            self.mask_host[:] = mask.reshape(-1)[: self.words]
        elif getattr(mask, "words", self.words) == self.words:
            mask.fill(self.mask_host)
        else:  # a vocabulary wider than the logits row (never allowed past it)
            full = np.empty(mask.words, dtype=np.int32)
            mask.fill(full)
            self.mask_host[:] = full[: self.words]
        cp.cuda.runtime.memcpyAsync(
            self.mask_dev.data.ptr,
            self.mask_host.ctypes.data,
            self.words * 4,
            cp.cuda.runtime.memcpyHostToDevice,
            stream.ptr,
        )

    def _upload_bias(self, bias: tuple[tuple[int, float], ...], stream: Any) -> None:
        """The (id, value) pairs to the device (only when they changed since the last upload)."""
        cp = self._cp
        n = len(bias)
        if n > self._bias_cap:
            stream.synchronize()
            self._grow_bias(n)
        for j, (token, value) in enumerate(bias):
            if not 0 <= token < self.vocab:
                raise GrammarError(f"token id {token} is outside the vocabulary (0..{self.vocab - 1})", "logit_bias")
            self.bias_ids_host[j] = token
            self.bias_vals_host[j] = value
        h2d = cp.cuda.runtime.memcpyHostToDevice
        cp.cuda.runtime.memcpyAsync(self.bias_ids_dev.data.ptr, self.bias_ids_host.ctypes.data, 4 * n, h2d, stream.ptr)
        cp.cuda.runtime.memcpyAsync(
            self.bias_vals_dev.data.ptr, self.bias_vals_host.ctypes.data, 4 * n, h2d, stream.ptr
        )
        self._bias_sent = bias


def sample_launches(
    kernels: tuple[Any, Any, Any], buf: Any, logits_dev: Any, flags: int
) -> list[tuple[Any, tuple[Any, ...]]]:
    """One sample's kernel sequence, (kernel, (grid, block, args)) each, for `kernels` = (smp_adjust,
    smp_prep, smp_select) on the buffers of `buf` (a `DeviceSampler`, or anything with its buffer
    attributes, `blocks` and `schedule`: tests/test_sample_host.py runs the sequence on the host):
    the bias / mask stage when `flags` asks, the penalties and the maximum, then the radix-select
    passes of each active stage (top-k, top-p, the draw)."""
    adjust, prep, select = kernels
    g, b = (buf.blocks,), (ks.THREADS,)
    out: list[tuple[Any, tuple[Any, ...]]] = []
    row = logits_dev
    if flags & (ks.F_MASK | ks.F_BIAS):
        args = (logits_dev, buf.params_dev, buf.mask_dev, buf.bias_ids_dev, buf.bias_vals_dev, buf.xa)
        out.append((adjust, (g, b, args)))
        row = buf.xa
    out += [
        (
            prep,
            (
                g,
                b,
                (
                    row,
                    buf.params_dev,
                    buf.recent_dev,
                    buf.xw,
                    buf.state,
                    buf.bv,
                    buf.bi,
                    buf.counter,
                    buf.out,
                ),
            ),
        )
    ]
    for sel, bit in ((0, ks.F_TOPK), (1, ks.F_TOPP), (2, ks.F_SAMPLE)):
        if flags & bit:
            for shift, nbits in buf.schedule:
                out.append(
                    (
                        select,
                        (
                            g,
                            b,
                            (
                                buf.xw,
                                buf.params_dev,
                                buf.state,
                                np.int32(sel),
                                np.int32(shift),
                                np.int32(nbits),
                                buf.ghist,
                                buf.counter,
                                buf.out,
                            ),
                        ),
                    )
                )
    return out


def _fill(pd: np.ndarray, pi: np.ndarray, params: SamplingParams, u: float, n_recent: int, flags: int) -> None:
    """One sample's parameters into a (pinned) parameter buffer."""
    pd[ks.PD_TOP_P] = params.top_p
    pd[ks.PD_MIN_P] = params.min_p
    pd[ks.PD_U] = u
    pd[ks.PD_TEMP] = params.temperature
    pd[ks.PD_PENALTY] = params.repeat_penalty
    pi[ks.PI_NRECENT] = n_recent
    pi[ks.PI_TOPK] = params.top_k
    pi[ks.PI_FLAGS] = flags
    pi[ks.PI_NBIAS] = len(params.logit_bias)
