"""Decode steps chained on the device: the device side of `engine.decode_chain.DecodeChain`.

A chained step is the decoder's step (its CUDA graph, or the same launches eagerly) reading its
token and position from the decoder's `ids` buffer on the device, then - for anything but plain
greedy - the device sampler (`DeviceSampler.queue`: its parameters from a pinned slot of their
own, the token left on the device), then `chain_advance` (one thread: the pick becomes ids[0],
ids[1] moves on by one, and the pick enters the repetition window's ring), then a 4-byte copy of
the pick into a pinned slot and an event. The host never writes `ids` between two chained steps,
so it can queue the next step before it has read this one's token; it reads each token once its
event has passed (`wait`).

`begin` writes the first step's token and position (the host knows them: the last token it
has read) and the repetition window; it is only called with nothing queued, so no queued copy
still reads the pinned buffers it fills. Plain greedy needs no sampler: `chain_advance` reads the
step's own argmax (ids[2]).

The chain allocates nothing on the device: pinned host slots and events only (made with the
decoder), kernel arguments are the decoder's and the sampler's fixed buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import cupy as cp
import numpy as np

from ..sampler import SamplingParams
from .cupy_sample import PARAM_SLOTS
from .cupy_sample import _module as _sample_module

if TYPE_CHECKING:
    from .cupy_decoder import CupyDecoder

SLOTS = PARAM_SLOTS
"""Steps that may be queued at once (pinned token slots, events, the sampler's parameter slots)."""
_H2D = cp.cuda.runtime.memcpyHostToDevice
_D2H = cp.cuda.runtime.memcpyDeviceToHost


class CupyChain:
    """The chained decode steps of one `CupyDecoder` (see the module doc); one chain at a time."""

    slots = SLOTS

    def __init__(self, decoder: CupyDecoder) -> None:
        self.dec = decoder
        self._advance = _sample_module().get_function("chain_advance")
        self._tok_mem = cp.cuda.alloc_pinned_memory(4 * SLOTS)
        self.tok_host = np.frombuffer(self._tok_mem, np.int32, SLOTS)
        self._events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(SLOTS)]
        self._pick_greedy = decoder.ids[2:3]  # the step's argmax
        self.params = SamplingParams(temperature=0.0)
        self.greedy = True
        self._cap = np.int32(0)
        self.launches = 0
        """Chained steps queued so far (tests and benchmarks)."""

    def begin(self, token: int, pos: int, params: SamplingParams, window: Sequence[int]) -> None:
        """Start a chain: the next step feeds `token` at `pos`, sampling by `params`, with the
        repetition window `window` (the last `repeat_last_n` ids, oldest first); nothing queued."""
        dec = self.dec
        if not 0 <= token < dec.spec.n_vocab:
            raise ValueError(f"token id {token} out of range")
        sampler = dec.device_sampler
        self.params = params
        self.greedy = params.temperature <= 0.0 and params.repeat_penalty == 1.0 and not params.logit_bias
        pen = params.repeat_penalty != 1.0 and params.repeat_last_n > 0
        cap = min(params.repeat_last_n, sampler.max_history) if pen else 0
        if len(window) > max(cap, 0):
            raise ValueError(f"window of {len(window)} ids, the ring holds {cap}")
        self._cap = np.int32(cap)
        stream = dec.stream
        # work queued on the caller's stream (a generic prefill) comes first
        dec._ready.record(cp.cuda.get_current_stream())
        stream.wait_event(dec._ready)
        ids = dec.ids_host
        ids[0], ids[1], ids[2], ids[3] = token, pos, 0, (len(window) % cap) if cap else 0
        cp.cuda.runtime.memcpyAsync(dec.ids.data.ptr, ids.ctypes.data, 16, _H2D, stream.ptr)
        if not self.greedy:
            sampler.prepare(params, window if cap else (), stream)

    def launch(self, slot: int, u: float, n_recent: int, pos: int) -> None:
        """Queue one step (its token and position from the device), its pick into slot `slot`
        (0..slots-1, one no queued step uses); `u`: the sampler's draw, `n_recent`: ids of the
        repetition window this step sees, `pos`: the position it feeds (the host's count, which
        picks the decoder's plan)."""
        dec = self.dec
        stream = dec.stream
        dec._run(pos)
        sampler = dec.device_sampler
        pick = self._pick_greedy
        if not self.greedy:
            sampler.queue(dec.out_logits, self.params, u, n_recent, stream, slot)
            pick = sampler.out
        with stream:
            self._advance((1,), (32,), (dec.ids, pick, sampler.recent_dev, self._cap))
        cp.cuda.runtime.memcpyAsync(self.tok_host.ctypes.data + 4 * slot, pick.data.ptr, 4, _D2H, stream.ptr)
        self._events[slot].record(stream)
        self.launches += 1

    def wait(self, slot: int) -> int:
        """The token of the step queued into `slot`, once it has finished."""
        self._events[slot].synchronize()
        return int(self.tok_host[slot])
