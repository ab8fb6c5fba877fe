"""A priority lock for the model: one generation holds it; a more urgent waiter makes it yield.

The KV cache holds one sequence, so one generation runs at a time. Waiters are served by
priority (higher first, FIFO within a priority). A holder checks `should_yield()` between two
steps; when a waiter outranks it, it releases the lock, queues again behind that waiter, and on
return rebuilds its context from the prefix cache (see `generate.py`). A holder that waits between
two steps (parked at the gate) registers `on_outranked` to be told at once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio


class PriorityLock:
    """Held by one owner at a time; `acquire(owner, priority)` waits by priority."""

    def __init__(self) -> None:
        self._holder: Any = None
        self._holder_priority = 0
        self._waiters: list[tuple[int, int, anyio.Event, Any, int]] = []
        self._seq = itertools.count()
        self._outranked: tuple[Any, Callable[[], None]] | None = None

    @property
    def locked(self) -> bool:
        return self._holder is not None

    def _top_priority(self) -> int | None:
        return -self._waiters[0][0] if self._waiters else None

    async def acquire(self, owner: Any, priority: int = 0) -> None:
        """Wait until `owner` holds the lock (cancellation leaves the queue cleanly)."""
        if self._holder is None and not self._waiters:
            self._holder, self._holder_priority = owner, priority
            return
        event = anyio.Event()
        entry = (-priority, next(self._seq), event, owner, priority)
        heapq.heappush(self._waiters, entry)
        if self._outranked is not None and priority > self._holder_priority:
            holder, notify = self._outranked
            if holder is self._holder:
                notify()
        try:
            await event.wait()
        except BaseException:
            if self._holder is owner:  # granted while being cancelled: pass it on
                self.release(owner)
            else:
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)
            raise

    def release(self, owner: Any) -> None:
        """Hand the lock to the most urgent waiter (or free it)."""
        if self._holder is not owner:
            raise RuntimeError("release by a task that does not hold the lock")
        self._holder = None
        if self._waiters:
            _, _, event, nxt, prio = heapq.heappop(self._waiters)
            self._holder, self._holder_priority = nxt, prio
            event.set()

    def should_yield(self, owner: Any) -> bool:
        """True when `owner` holds the lock and a waiter has a higher priority."""
        top = self._top_priority()
        return self._holder is owner and top is not None and top > self._holder_priority

    @contextmanager
    def on_outranked(self, owner: Any, notify: Callable[[], None]) -> Iterator[None]:
        """While in the block, call `notify()` when a waiter that outranks `owner` (the holder) arrives."""
        prev, self._outranked = self._outranked, (owner, notify)
        try:
            yield
        finally:
            self._outranked = prev

    @asynccontextmanager
    async def hold(self, priority: int = 0) -> AsyncIterator[None]:
        """`async with lock.hold():` — hold the lock for a block of code."""
        owner = object()
        await self.acquire(owner, priority)
        try:
            yield
        finally:
            self.release(owner)
