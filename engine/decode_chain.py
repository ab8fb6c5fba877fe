"""The decode loop on the device, host side: steps queued ahead, tokens read back one step behind.

A backend whose decoder can chain steps (`decoder.chain(params)` returns a device chain: the CuPy
decoder's `engine.backends.cupy_chain.CupyChain`) runs every step reading the previous step's
token from device memory, so the host can queue step k+1 before it has read step k's token. The
generation (`engine.generate`) keeps one step queued ahead of the one whose token it waits for:
while it streams token k and checks the stops, the device already runs the step after it.

`DecodeChain` is what the generation holds: it draws each step's uniform number from the
generation's `Sampler` in step order (a seed gives the tokens of the step-by-step path), gives
each queued step its own slot, keeps the KV cache's token list (`kv.tokens`) equal to the tokens
whose K/V are written or queued, and waits for tokens in a worker thread (`step`, `settle`).

A step queued ahead costs pause reaction: a pause that comes while step k runs with step k+1
queued lands after both. So a step is queued ahead only while steps are short
(`AHEAD_MAX_STEP_S`: the last step's time, read-to-read, at most 5 ms - the GPU idling for the
host's part of a token matters there, and two steps stay under 10 ms); longer steps (a 4B model on
an Orin) run one at a time, the host's ~0.2 ms then a few percent of a step, and a pause lands
within one step as before.

A device chain offers `slots`, `begin(token, pos, params, window)` (nothing queued: the first
step feeds a token the host knows), `launch(slot, u, n_recent)` (queue one step) and
`wait(slot) -> token`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from .errors import ContextOverflowError
from .sampler import Sampler

AHEAD_MAX_STEP_S = 0.005
"""Longest step (seconds, read to read) after which a step is still queued ahead (see the module doc)."""


class DecodeChain:
    """Chained decode steps of one generation (see the module doc). `step` and `settle` block:
    call them in a worker thread; the rest is bookkeeping on the caller's thread."""

    def __init__(
        self, transformer: Any, lock: threading.Lock, sampler: Sampler, history: Sequence[int], device: Any
    ) -> None:
        self.tf = transformer
        self.history = history
        """The generation's ids so far (prompt, then tokens), growing as it takes them: the
        repetition window of a run's first step comes from it."""
        self.lock = lock
        """The model's thread lock, held while steps are queued and the cache's tokens change."""
        self.sampler = sampler
        self.params = sampler.params
        self.device = device
        self.queued: deque[tuple[int, int]] = deque()
        """(slot, position fed) of the steps queued on the device, oldest first."""
        self.ready: deque[int] = deque()
        """Tokens read back by `settle` that the generation has not taken yet, oldest first."""
        self._launched = 0
        self._next_pos = 0
        self._read_at: float | None = None
        self.step_s = 0.0
        """The last step's time, from one token read to the next while a step stayed queued
        (0: not measured yet)."""
        p = self.params
        self._window = p.repeat_last_n if p.repeat_penalty != 1.0 and p.repeat_last_n > 0 else 0

    @property
    def ahead_ok(self) -> bool:
        """Whether steps are short enough to keep one queued ahead (`AHEAD_MAX_STEP_S`)."""
        return self.step_s <= AHEAD_MAX_STEP_S

    @property
    def in_flight(self) -> int:
        """Steps queued on the device and not read back."""
        return len(self.queued)

    def step(self, token: int, pos: int, launch: bool, collect: bool) -> int | None:
        """Queue one step when `launch` (with nothing queued it feeds `token` at `pos`; else the
        newest queued step's token at the next position), then, when `collect`, wait for the
        oldest queued step and return its token. Blocks: run it in a worker thread."""
        with self.lock:
            if launch:
                if self.queued:
                    self._launch()
                else:
                    self._begin(token, pos)
        return self._collect() if collect else None

    def settle(self) -> None:
        """Wait for every queued step; their tokens go to `ready` (nothing stays queued)."""
        while self.queued:
            self.ready.append(self._collect())

    def _begin(self, token: int, pos: int) -> None:
        """The first step of a run: `token` (host-known) at `pos`; the cache keeps `pos` tokens."""
        kv = self.tf.kv
        del kv.tokens[pos:]
        if len(kv.tokens) != pos:
            raise ValueError(f"the cache holds {len(kv.tokens)} tokens, the step feeds position {pos}")
        window = window_of(self.history[: pos + 1], self._window)
        self.device.begin(int(token), pos, self.params, window)
        kv.tokens.append(int(token))
        self._read_at = None
        self._next_pos = pos
        self._launch()

    def _launch(self) -> None:
        """Queue the step feeding position `_next_pos` (its token: the device's last pick)."""
        pos = self._next_pos
        if pos >= self.tf.n_ctx:
            raise ContextOverflowError(pos + 1, self.tf.n_ctx)
        if len(self.queued) >= self.device.slots:
            raise RuntimeError(f"{len(self.queued)} steps queued: every slot is in use")
        u = self.sampler.uniform() if self.params.temperature > 0.0 else 0.0
        slot = self._launched % self.device.slots
        self.device.launch(slot, u, min(pos + 1, self._window), pos)
        self._launched += 1
        self.queued.append((slot, pos))
        self._next_pos = pos + 1

    def _collect(self) -> int:
        """Wait for the oldest queued step; its token. A step still queued after it feeds that
        token, so the cache's token list gains it (its K/V are being written)."""
        slot, pos = self.queued[0]
        token = int(self.device.wait(slot))
        now = time.perf_counter()
        if self._read_at is not None:  # the device went from the last read to this one without waiting for the host
            self.step_s = now - self._read_at
        with self.lock:
            self.queued.popleft()
            if self.queued:
                kv = self.tf.kv
                del kv.tokens[pos + 1 :]
                kv.tokens.append(token)
        self._read_at = now if self.queued else None
        return token


def window_of(history: Sequence[int], n: int) -> list[int]:
    """The last `n` ids of `history` (the repetition window as `Sampler.pick` slices it)."""
    return [int(t) for t in history[-n:]] if n > 0 else []
