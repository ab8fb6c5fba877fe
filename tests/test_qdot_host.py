"""The decode GEMVs' integer dot products, compiled for the host (tests/qdot_host.py), equal the
dequantized weights times the rounded activations for every chunk code, on random stored bytes
(every nibble, 6-bit value and packed scale pattern) - so the kernels' arithmetic is checked on a
machine without a GPU. Skipped without a C++ compiler (failed under CI=true)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.quants import dequantize
from engine.quants_encode import random_blocks
from tests.cuda_host import cxx_or_skip
from tests.qdot_host import CODES, GROUP, TYPE_OF, HostDots, activations, chunk_values

pytestmark = pytest.mark.timeout(300)

COLS = 1024
"""Four K-quant super-blocks a row: every sub-block pair j of the Q4_K scale packing, twice."""


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> HostDots:
    """The dot products built once for this module."""
    cxx = cxx_or_skip("the kernels' dot products")
    return HostDots(Path(tmp_path_factory.mktemp("qdot")), cxx)


def reference(code: str, row: np.ndarray, xq: np.ndarray, xd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each chunk's sum of dequantized weight x rounded activation over the values it holds
    (float64), and the sum of the terms' magnitudes (the scale of float rounding)."""
    t = TYPE_OF[code]
    w = dequantize(row, t, (1, xq.size))[0].astype(np.float64)
    x = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), GROUP[t])
    terms = (w * x)[chunk_values(code, xq.size)]
    return terms.sum(axis=1), np.abs(terms).sum(axis=1)


@pytest.mark.parametrize("code", sorted(CODES))
def test_dot_products_match_dequantized_weights(host: HostDots, code: str) -> None:
    """Every chunk of 64 random rows equals the float64 sum of its dequantized weights times the
    activations, within float rounding."""
    rng = np.random.default_rng(sorted(CODES).index(code))
    t = TYPE_OF[code]
    rows = random_blocks(rng, t, 64, COLS, 0.05)
    for r in range(rows.shape[0]):
        xq, xd, xs16 = activations(rng, COLS, GROUP[t])
        got = host.dots(code, rows[r], xq, xd, xs16).astype(np.float64)
        want, scale = reference(code, rows[r], xq, xd)
        bad = np.abs(got - want) > 1e-5 * scale + 1e-30
        assert not bad.any(), (code, r, np.flatnonzero(bad)[:5], got[bad][:3], want[bad][:3])


@pytest.mark.parametrize("pair", [("Q4_K", "Q4_K2"), ("Q6_K", "Q6_K2")])
def test_two_chunk_widths_agree(host: HostDots, pair: tuple[str, str]) -> None:
    """A K-quant row dotted in 64-value chunks equals the same row in 32-value chunks added in pairs
    (the plain and the gate+up GEMVs read the same weights two ways)."""
    rng = np.random.default_rng(7)
    narrow, wide = pair
    rows = random_blocks(rng, TYPE_OF[narrow], 16, COLS, 0.05)
    for r in range(rows.shape[0]):
        xq, xd, xs16 = activations(rng, COLS, 256)
        a = host.dots(narrow, rows[r], xq, xd, xs16).astype(np.float64).reshape(-1, 2).sum(axis=1)
        b = host.dots(wide, rows[r], xq, xd, xs16).astype(np.float64)
        _, scale = reference(wide, rows[r], xq, xd)
        assert np.all(np.abs(a - b) <= 1e-5 * scale + 1e-30), (pair, r)


def test_a_wrong_scale_is_caught(host: HostDots) -> None:
    """Changing one packed Q4_K scale byte of a row changes the dot product of the chunks it
    scales and only those (the check above can fail)."""
    rng = np.random.default_rng(11)
    row = random_blocks(rng, "Q4_K", 1, COLS, 0.05)[0].copy()
    xq, xd, xs16 = activations(rng, COLS, 256)
    before = host.dots("Q4_K2", row, xq, xd, xs16)
    row[4 + 9] ^= 0x01  # super-block 0, scale byte 9: low bit of sub-block 5's scale (pair j = 2)
    after = host.dots("Q4_K2", row, xq, xd, xs16)
    changed = np.flatnonzero(before != after)
    assert changed.tolist() == [2]
