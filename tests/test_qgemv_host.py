"""The decode step's integer GEMV kernels (`qdot_src`: `qprep_x`, `qgemv_<T>`, `qgemv_glu_<T>`,
`qgemv_mix_<A>_<B>`) run on the host (tests/cuda_host.py: a std::thread a CUDA thread) and give
what NumPy gives: the input rounding of llama.cpp, and the dequantized weights times the rounded
input with every epilogue, threads-a-row setting, row tail and grid stride - the kernels' indexing
checked on a machine without a GPU. Skipped without a C++20 compiler (failed under CI=true)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backends.numpy_backend import NumpyOps
from engine.kernels import decode_src, qdot_src
from engine.kernels.quant_units import UNITS
from tests.cuda_host import HostModule, cxx_or_skip
from tests.qdot_host import activations, stored_rows

pytestmark = pytest.mark.timeout(600)

TYPES = ("Q4_K", "Q6_K", "Q4_1", "Q8_0")
COLS = 1024
"""Four K-quant super-blocks, 32 legacy blocks: each chunk position of a row is exercised."""
AQ = {t: qdot_src.QTYPES[t] for t in TYPES}
"""Each type's input rounding: 1 q8_0 (groups of 32), 2 q8_k (groups of 256)."""


@pytest.fixture(scope="module")
def mod(tmp_path_factory: pytest.TempPathFactory) -> HostModule:
    """The integer GEMV kernels of every type, as the decode module has them, built once."""
    cxx = cxx_or_skip("the GEMV kernels")
    src = UNITS + decode_src.COMMON + qdot_src.round_source() + qdot_src.source(list(TYPES))
    return HostModule(Path(tmp_path_factory.mktemp("qgemv")), src, cxx, "qgemv")


def weights(rng: np.random.Generator, t: str, rows: int, cols: int = COLS) -> tuple[np.ndarray, np.ndarray, int]:
    """Random stored rows, their float64 values and the bytes a row (`qdot_host.stored_rows`)."""
    return stored_rows(rng, t, rows, cols)


def rounded(
    rng: np.random.Generator, t: str, cols: int = COLS
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A random rounded input as `qprep_x` leaves it, and its values (xq x scale) in float64."""
    group = 256 if AQ[t] == 2 else 32
    xq, xd, xs16 = activations(rng, cols, group)
    return xq, xd, xs16, xq.astype(np.float64) * np.repeat(xd.astype(np.float64), group)


def close(got: np.ndarray, want: np.ndarray, scale: np.ndarray) -> bool:
    """Equal within float rounding of sums whose terms' magnitudes add up to `scale`."""
    return bool(np.all(np.abs(got.astype(np.float64) - want) <= 2e-5 * scale + 1e-6))


@pytest.mark.parametrize("aq", [1, 2])
def test_input_rounding_matches_numpy(mod: HostModule, aq: int) -> None:
    """`qprep_x` RMS-normalises and rounds as `NumpyOps.act_quant` does: the same int8 values but
    for rare ties moved by float summation order, per-group scales to float rounding, and per-16
    sums of its own values exactly."""
    rng = np.random.default_rng(aq)
    x = (rng.standard_normal(COLS) * 2).astype(np.float32)
    nw = (rng.random(COLS) + 0.5).astype(np.float32)
    eps = 1e-6
    xq, xd, xs16 = np.zeros(COLS, np.int8), np.zeros(COLS // 32, np.float32), np.zeros(COLS // 16, np.int32)
    groups = COLS // (32 if aq == 1 else 256)
    mod.launch("qprep_x", -(-groups // 8), 256, x, nw, eps, aq, COLS, xq, xd, xs16)
    group = 32 if aq == 1 else 256
    xn = (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps) * nw).astype(np.float32)
    ref = NumpyOps.act_quant(xn[None], "q8_0" if aq == 1 else "q8_k")[0].astype(np.float64)
    got = xq.astype(np.float64) * np.repeat(xd[:groups].astype(np.float64), group)
    assert np.mean(np.abs(got - ref) > 1e-6 * np.abs(ref).max()) < 0.01
    d_ref = np.abs(ref.reshape(groups, group)).max(axis=1) / 127
    assert np.allclose(np.abs(xd[:groups]), d_ref, rtol=1e-5)
    assert np.array_equal(xs16, xq.astype(np.int32).reshape(-1, 16).sum(axis=1))
    assert np.abs(xq.astype(np.int32)).max() >= 126


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("tpr", [8, 16, 64, 256])
def test_plain_gemv_store_and_add(mod: HostModule, t: str, tpr: int) -> None:
    """`qgemv_<T>` over 37 rows (a partial last row group) on a 2-block grid (blocks striding over
    the groups), with inputs long enough that every thread of a row has chunks (64 values a
    thread: the warps' partial sums meet in shared memory from 64 threads a row): store + bias
    equals W @ x + b, and add equals y + W @ x."""
    rng = np.random.default_rng(tpr + 7 * TYPES.index(t))
    rows, cols = 37, max(COLS, 64 * tpr)
    w_buf, w, nb = weights(rng, t, rows, cols)
    xq, xd, xs16, x = rounded(rng, t, cols)
    bias = rng.standard_normal(rows).astype(np.float32)
    y0 = rng.standard_normal(rows).astype(np.float32)
    scale = np.abs(w) @ np.abs(x)
    y = np.full(rows, np.nan, np.float32)
    mod.launch(f"qgemv_{t}", 2, 256, w_buf, nb, rows, cols, xq, xd, xs16, y, bias, 0, 0, tpr)
    assert close(y, w @ x + bias, scale), (t, tpr)
    y = y0.copy()
    mod.launch(f"qgemv_{t}", 2, 256, w_buf, nb, rows, cols, xq, xd, xs16, y, None, 1, 0, tpr)
    assert close(y, y0 + w @ x, scale), (t, tpr)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("epi", [2, 3])
def test_gate_up_gemv(mod: HostModule, t: str, epi: int) -> None:
    """`qgemv_glu_<T>`: output r is SwiGLU (2) or GeGLU (3) of gate row r and up row r + F."""
    rng = np.random.default_rng(epi + 11 * TYPES.index(t))
    f = 21
    w_buf, w, nb = weights(rng, t, 2 * f)
    xq, xd, xs16, x = rounded(rng, t)
    g, u = w[:f] @ x, w[f:] @ x
    want = (
        g / (1 + np.exp(-g)) * u
        if epi == 2
        else 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u
    )
    y = np.full(f, np.nan, np.float32)
    mod.launch(f"qgemv_glu_{t}", 3, 256, w_buf, nb, f, COLS, xq, xd, xs16, y, None, epi, f, 16)
    scale = (np.abs(w[:f]) @ np.abs(x)) * np.abs(u) + np.abs(g) * (np.abs(w[f:]) @ np.abs(x))
    assert close(y, want, scale), (t, epi)


@pytest.mark.parametrize("pair", qdot_src.mix_pairs(list(TYPES)))
def test_two_piece_gemv(mod: HostModule, pair: tuple[str, str]) -> None:
    """`qgemv_mix_<A>_<B>`: blocks below `nblk_a` give piece A's rows, the others piece B's after
    them, each with its own threads a row - the two pieces' W @ x + b."""
    a, b = pair
    rng = np.random.default_rng(len(a) + 3 * len(b))
    ra, rb = 19, 9
    wa_buf, wa, nba = weights(rng, a, ra)
    wb_buf, wb, nbb = weights(rng, b, rb)
    xq, xd, xs16, x = rounded(rng, a)
    bias = rng.standard_normal(ra + rb).astype(np.float32)
    y = np.full(ra + rb, np.nan, np.float32)
    args = (wa_buf, nba, ra, 16, 2, wb_buf, nbb, rb, 64, COLS, xq, xd, xs16, y, bias, 0)
    mod.launch(f"qgemv_mix_{a}_{b}", 3, 256, *args)
    want = np.concatenate([wa @ x, wb @ x]) + bias
    scale = np.concatenate([np.abs(wa) @ np.abs(x), np.abs(wb) @ np.abs(x)])
    assert close(y, want, scale), pair
