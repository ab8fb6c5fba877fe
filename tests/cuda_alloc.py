"""Counting CuPy allocations in GPU tests (only imported where CuPy is present)."""

from __future__ import annotations

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
