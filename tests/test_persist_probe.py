"""bench.persist_probe turns the decode step's integer GEMV launches into the persistent kernel's
job table: one job a launch (two for a two-piece QKV, the barrier after the second), the layout of
the CUDA struct `PJob` (three 64-bit fields, then eight 32-bit ones)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from bench.persist_probe import KINDS, jobs_of

pytestmark = pytest.mark.timeout(30)


def _dev(addr: int) -> Any:
    """A stand-in for a device array: only its address is read."""
    return SimpleNamespace(data=SimpleNamespace(ptr=addr))


def _launch(name: str, *args: Any) -> Any:
    return SimpleNamespace(name=name, args=args)


def test_jobs_follow_the_launches_and_the_struct_layout() -> None:
    """A two-piece QKV gives two jobs (the second's output after the first's rows, one barrier after
    both), a GLU GEMV a GLU job with its up-row offset, a plain GEMV a plain job; other launches
    (input rounding, attention) none; each row packs W, row bytes, y, then the int pairs."""
    i32 = np.int32
    x = (_dev(0x900), _dev(0xA00), _dev(0xB00))  # xq, xd, xs16
    plan = [
        _launch("qprep[2560]", _dev(1), 0),
        _launch(
            "qgemv_mix_Q4_K_Q6_K[5120+1024x2560]",
            _dev(0x1000),
            np.int64(1440),
            i32(5120),
            i32(64),
            i32(80),
            _dev(0x2000),
            np.int64(2100),
            i32(1024),
            i32(32),
            i32(2560),
            *x,
            _dev(0x3000),
            np.uint64(0),
            i32(0),
        ),
        _launch("attn", _dev(2)),
        _launch(
            "qgemv_Q4_K[9728x2560]",
            _dev(0x4000),
            np.int64(1440),
            i32(9728),
            i32(2560),
            *x,
            _dev(0x5000),
            np.uint64(0),
            i32(2),
            i32(9728),
            i32(16),
        ),
        _launch(
            "qgemv_Q6_K[2560x9728]",
            _dev(0x6000),
            np.int64(7980),
            i32(2560),
            i32(9728),
            *x,
            _dev(0x7000),
            np.uint64(0),
            i32(1),
            i32(0),
            i32(64),
        ),
    ]
    table, gemvs = jobs_of(plan)
    assert [g.name for g in gemvs] == [plan[1].name, plan[3].name, plan[4].name]
    assert table.dtype == np.int64 and table.shape == (4, 7)

    def ints(row: np.ndarray) -> list[int]:
        return [int(v) >> s & 0xFFFFFFFF for v in row[3:] for s in (0, 32)]

    assert table[:, :3].tolist() == [
        [0x1000, 1440, 0x3000],
        [0x2000, 2100, 0x3000 + 4 * 5120],  # V rows written after the 5120 Q and K rows
        [0x4000, 1440, 0x5000],
        [0x6000, 7980, 0x7000],
    ]
    # rows, cols, threads a row, kind, epilogue, up-row offset, barrier after, padding
    assert ints(table[0]) == [5120, 2560, 64, KINDS[("Q4_K", False)], 0, 0, 0, 0]
    assert ints(table[1]) == [1024, 2560, 32, KINDS[("Q6_K", False)], 0, 0, 1, 0]
    assert ints(table[2]) == [9728, 2560, 16, KINDS[("Q4_K", True)], 2, 9728, 1, 0]
    assert ints(table[3]) == [2560, 9728, 64, KINDS[("Q6_K", False)], 1, 0, 1, 0]
