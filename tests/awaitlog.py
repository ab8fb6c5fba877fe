"""An append-only list of observations that tests can await a matching entry in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio


class Log:
    """Collects what a component publishes; `wait_for` returns the first entry matching a predicate."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._changed = anyio.Event()

    def __call__(self, item: Any) -> None:
        self.items.append(item)
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, pred: Callable[[Any], Any], start: int = 0, within_s: float = 5.0) -> Any:
        with anyio.fail_after(within_s):
            while True:
                for item in self.items[start:]:
                    if pred(item):
                        return item
                await self._changed.wait()


class Arrivals(list[Any]):
    """A list filled as things arrive (tokens, stream pieces) that tests can await a length of."""

    def __init__(self) -> None:
        super().__init__()
        self.done = anyio.Event()
        """Set by `finish`: nothing more will come."""
        self._changed = anyio.Event()

    def add(self, item: Any) -> None:
        """Append `item` and wake the waiters."""
        self.append(item)
        self._changed.set()
        self._changed = anyio.Event()

    def finish(self) -> None:
        """Mark the end: every wait returns."""
        self.done.set()
        self._changed.set()

    async def wait_len(self, n: int) -> None:
        """Return once `n` items arrived or nothing more will come."""
        while len(self) < n and not self.done.is_set():
            await self._changed.wait()
