"""Counting CuPy allocations in GPU tests (only imported where CuPy is present)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import cupy as cp


class AllocCounter(cp.cuda.memory_hook.MemoryHook):
    """A memory hook counting pool mallocs (`mallocs`) and device allocations (`allocs`); use it
    as a context manager around the code that must allocate nothing."""

    name = "genie_alloc_counter"

    def __init__(self) -> None:
        self.mallocs = 0
        self.allocs = 0

    def malloc_preprocess(self, **kw: Any) -> None:
        self.mallocs += 1

    def alloc_preprocess(self, **kw: Any) -> None:
        self.allocs += 1


@contextmanager
def allocates_nothing() -> Iterator[AllocCounter]:
    """Asserts that the block (its queued work included) makes no pool malloc and no device allocation and
    leaves the pool's used and total bytes as they were."""
    cp.cuda.Device().synchronize()
    pool = cp.get_default_memory_pool()
    used, total = pool.used_bytes(), pool.total_bytes()
    hook = AllocCounter()
    with hook:
        yield hook
    cp.cuda.Device().synchronize()
    assert (hook.mallocs, hook.allocs) == (0, 0)
    assert (pool.used_bytes(), pool.total_bytes()) == (used, total)
