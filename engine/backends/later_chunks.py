"""Which later prefill chunks replay CUDA graphs: the bookkeeping of `cupy_prefill_graph`'s
later-chunk graphs, free of CuPy so that its rules are tested on any machine.

A later chunk (start > 0) of 2..`later_max` tokens is padded to a multiple of LATER_STEP tokens
(`later_bucket`). Its start is due for a capture (`Sightings.due`) at its second sighting, or at
its first once `expect` named it (a restored or pinned prefix ends there: questions begin there);
a chunk of exactly `later_max` tokens only at a named start, since with chunks that short (the
Orin profile's 64) it may be the middle of a long prompt, whose starts would cycle through the
LATER_KEEP kept graphs, each captured and never replayed. SEEN_KEEP starts of each kind are
remembered, the oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

LATER_STEP = 16
"""Later chunks are padded to a multiple of this many tokens."""
LATER_KEEP = 8
"""Later-chunk graphs kept (least recently used dropped first)."""
SEEN_KEEP = 16
"""Chunk starts remembered, seen and named apart."""


def later_bucket(t: int, start: int, later_max: int) -> int | None:
    """The padded length a later chunk of `t` tokens at `start` replays at, or None: not a later
    chunk a graph takes (start 0, fewer than 2 or more than `later_max` tokens, graphs off)."""
    if not later_max or start <= 0 or not 2 <= t <= later_max:
        return None
    return min(-(-t // LATER_STEP) * LATER_STEP, later_max)


def keep_recent(entries: OrderedDict[Any, Any], keep: int) -> None:
    """Drop the least recently used (first) entries past `keep`."""
    while len(entries) > keep:
        entries.popitem(last=False)


class Sightings:
    """The starts later chunks began at (`due` records them) and the starts named ahead (`expect`)."""

    def __init__(self, later_max: int, keep: int = SEEN_KEEP) -> None:
        self.later_max = later_max
        self.keep = keep
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._expected: OrderedDict[int, None] = OrderedDict()

    def expect(self, start: int) -> None:
        """Chunks will begin at `start`: the first one there is due at once."""
        if start > 0:
            self._remember(self._expected, start)

    def due(self, t: int, start: int) -> bool:
        """Whether a chunk of `t` tokens at `start` is due for a capture (module doc); records it."""
        due = start in self._expected or (start in self._seen and t < self.later_max)
        self._remember(self._seen, start)
        return due

    def _remember(self, keys: OrderedDict[int, None], start: int) -> None:
        keys[start] = None
        keys.move_to_end(start)
        keep_recent(keys, self.keep)
