"""The merge loop both tokenizers share: join adjacent symbols, best pair first."""

from __future__ import annotations

import heapq
from collections.abc import Callable


def merge_pairs(syms: list[str], priority: Callable[[str, str], float | None]) -> list[int]:
    """Merge adjacent symbols of `syms` in place until no pair has a priority.

    The pair with the lowest `priority(a, b)` merges first (leftmost on ties); None means the pair
    never merges. Merged-away slots become "". Returns the `next` links: the surviving symbols, in
    order, are reached from index 0 by following them until -1.
    """
    n = len(syms)
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[float, int, int, str]] = []
    for i in range(n - 1):
        p = priority(syms[i], syms[i + 1])
        if p is not None:
            heap.append((p, i, i + 1, syms[i] + syms[i + 1]))
    heapq.heapify(heap)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        a, b = syms[left], syms[right]
        if not a or not b or a + b != merged:
            continue  # outdated: one side has been merged since
        syms[left] = merged
        syms[right] = ""
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prev[after] = left
        before = prev[left]
        if before >= 0:
            p = priority(syms[before], merged)
            if p is not None:
                heapq.heappush(heap, (p, before, left, syms[before] + merged))
        if after >= 0:
            p = priority(merged, syms[after])
            if p is not None:
                heapq.heappush(heap, (p, left, after, merged + syms[after]))
    return nxt
