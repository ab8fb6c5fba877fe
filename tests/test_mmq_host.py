"""The prefill GEMMs (`mmq_src`: `mmq_h_<T>`, `mmq_w_<T>`, `mmq_sum`, `act_q8_k_i8`,
`mmq_i8_Q4_K`) on the host (tests/cuda_host.py, whose `host_ldmatrix_x4` / `host_mma` run the
warp-wide tensor-core instructions by the PTX fragment layouts) against NumPy: every tensor type's
weights and the inputs in fp16 with float32 sums, ragged rows and tokens, a K split summed by
`mmq_sum`, and the int8 path against llama.cpp's q8_k rounding. Skipped without a C++20 compiler (failed under CI=true)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine import kernels
from engine.backends.numpy_backend import NumpyOps
from engine.kernels import quant_units
from engine.kernels.mmq_src import MMQ_BM
from tests.cuda_host import HostModule, cxx_or_skip
from tests.qdot_host import stored_rows

pytestmark = pytest.mark.timeout(600)

TYPES = quant_units.TYPES
"""Every tensor type: each has its mmq_h_<T> / mmq_w_<T> (the unit decoder inside the GEMM)."""


@pytest.fixture(scope="module")
def mod(tmp_path_factory: pytest.TempPathFactory) -> HostModule:
    """The prefill GEMM module (`kernels.mmq_source`), built once."""
    return HostModule(
        Path(tmp_path_factory.mktemp("mmq")), kernels.mmq_source(), cxx_or_skip("the prefill GEMMs"), "mmq"
    )


def weights(rng: np.random.Generator, t: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Random stored rows, their float64 values and the bytes a row (`qdot_host.stored_rows`)."""
    return stored_rows(rng, t, rows, cols)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("kernel,tokens,splits", [("mmq_h", 40, 1), ("mmq_w", 72, 1), ("mmq_h", 40, 3)])
def test_fp16_gemm(mod: HostModule, t: str, kernel: str, tokens: int, splits: int) -> None:
    """Y[t, m] = sum_k X[t, k] W[m, k] with W and X rounded to fp16 and float32 sums, over 150 rows
    (a partial second row tile) and a token tile partly filled; with a K split, the slices in P
    summed by `mmq_sum` give the same."""
    rng = np.random.default_rng(len(t) + tokens + splits)
    m, k = 150, 512
    w_buf, w, nb = weights(rng, t, m, k)
    x = rng.standard_normal((tokens, k)).astype(np.float16)
    y = np.full((tokens, m), np.nan, np.float32)
    bn = 64 if kernel == "mmq_h" else 128
    grid = (-(-tokens // bn), -(-m // MMQ_BM), splits)
    part = np.zeros((splits, tokens, m), np.float32) if splits > 1 else None
    mod.launch(f"{kernel}_{t}", grid, 256, w_buf, nb, x.view(np.uint16), y, m, m, k, tokens, part)
    if part is not None:
        mod.launch("mmq_sum", -(-(tokens * m) // 256), 256, part, splits, y, m, m, tokens)
    w16 = w.astype(np.float16).astype(np.float64)
    want = x.astype(np.float64) @ w16.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w16).T
    assert np.all(np.abs(y - want) <= 1e-5 * scale + 1e-6), (t, kernel, splits)


def test_int8_gemm(mod: HostModule) -> None:
    """`act_q8_k_i8` rounds the chunk as `NumpyOps.act_quant(x, "q8_k")` does, and `mmq_i8_Q4_K`
    multiplies the Q4_K weight by it with llama.cpp's integer arithmetic: y = W @ round(x)."""
    rng = np.random.default_rng(5)
    m, k, tokens = 150, 512, 40
    w_buf, w, nb = weights(rng, "Q4_K", m, k)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    q, d, s = (
        np.zeros((tokens, k), np.int8),
        np.zeros((tokens, k // 256), np.float32),
        np.zeros((tokens, k // 32), np.int32),
    )
    groups = tokens * k // 256
    mod.launch("act_q8_k_i8", -(-groups // 8), 256, x, q, d, s, groups)
    xr = NumpyOps.act_quant(x, "q8_k").astype(np.float64)
    assert np.allclose(q.astype(np.float64) * np.repeat(d, 256, axis=1), xr, rtol=1e-6, atol=1e-7)
    assert np.array_equal(s, q.astype(np.int32).reshape(tokens, -1, 32).sum(axis=2))
    y = np.full((tokens, m), np.nan, np.float32)
    mod.launch("mmq_i8_Q4_K", (-(-tokens // 64), -(-m // MMQ_BM), 1), 256, w_buf, nb, q, d, s, y, m, m, k, tokens, None)
    want = xr @ w.T
    assert np.all(np.abs(y - want) <= 1e-5 * (np.abs(xr) @ np.abs(w).T) + 1e-6)
