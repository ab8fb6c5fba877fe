"""The decode module's float-path kernels on the host (tests/cuda_host.py) against NumPy, for every
tensor type's 32-value decoder (`quant_units`): `dgemv_<T>` / `dgemv2_<T>` (RMSNorm, optional
rounding, store + bias, residual add, SwiGLU), `embed_<T>`, and the small kernels `argmax_ids`
(first index on ties, several blocks), `add_rmsnorm` and `glu`. Skipped without a C++20 compiler
(failed under CI=true)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backends.numpy_backend import NumpyOps
from engine.kernels import decode_src
from engine.kernels.quant_units import TYPES
from tests.cuda_host import HostModule, cxx_or_skip
from tests.qdot_host import stored_rows

pytestmark = pytest.mark.timeout(600)

COLS = 512
EPS = 1e-6


@pytest.fixture(scope="module")
def mod(tmp_path_factory: pytest.TempPathFactory) -> HostModule:
    """A decode module with a GEMV, gate+up and embedding kernel for every tensor type."""
    cxx = cxx_or_skip("the decode kernels")
    shape = dict(n_heads=4, n_kv_heads=2, head_dim=64, v_head_dim=64, rope_half=32, neox=True, kv_half=True, n_split=4)
    src = decode_src.source(list(TYPES), **shape)  # type: ignore[arg-type]
    return HostModule(Path(tmp_path_factory.mktemp("decode")), src, cxx, "decode")


def weights(rng: np.random.Generator, t: str, rows: int, cols: int = COLS) -> tuple[np.ndarray, np.ndarray, int]:
    """Random stored rows, their float64 values and the bytes a row (`qdot_host.stored_rows`)."""
    return stored_rows(rng, t, rows, cols)


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("r", [1, 2])
def test_float_gemv(mod: HostModule, t: str, r: int) -> None:
    """`dgemv_<T>` (one row a warp) and `dgemv2_<T>` (two): y = W rms_norm(x) + b, then y += W x
    without the norm, on 37 rows over a 2-block grid."""
    rng = np.random.default_rng(TYPES.index(t) + 50 * r)
    rows = 37
    w_buf, w, nb = weights(rng, t, rows)
    x = rng.standard_normal(COLS).astype(np.float32)
    nw = (rng.random(COLS) + 0.5).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    kernel = f"dgemv{'2' if r == 2 else ''}_{t}"
    y = np.full(rows, np.nan, np.float32)
    mod.launch(kernel, 2, 256, w_buf, nb, rows, COLS, x, nw, np.float32(EPS), 0, y, bias, 0, 0)
    xn = NumpyOps.rms_norm(x, nw, EPS).astype(np.float64)
    assert np.allclose(y, w @ xn + bias, rtol=1e-4, atol=1e-4 * np.abs(w) @ np.abs(xn)), t
    y0 = rng.standard_normal(rows).astype(np.float32)
    y = y0.copy()
    mod.launch(kernel, 2, 256, w_buf, nb, rows, COLS, x, None, np.float32(EPS), 0, y, None, 1, 0)
    assert np.allclose(y, y0 + w @ x, rtol=1e-4, atol=1e-4 * np.abs(w) @ np.abs(x)), t


@pytest.mark.parametrize("aq,kind", [(1, "q8_0"), (2, "q8_k")])
def test_float_gemv_rounds_its_input(mod: HostModule, aq: int, kind: str) -> None:
    """With `aq` the GEMV rounds its normalised input as `NumpyOps.act_quant` does before the
    product (F16 weights: the float path with llama.cpp's rounding)."""
    rng = np.random.default_rng(aq)
    rows = 16
    w_buf, w, nb = weights(rng, "F16", rows)
    x = rng.standard_normal(COLS).astype(np.float32)
    nw = (rng.random(COLS) + 0.5).astype(np.float32)
    y = np.zeros(rows, np.float32)
    mod.launch("dgemv_F16", 1, 256, w_buf, nb, rows, COLS, x, nw, np.float32(EPS), aq, y, None, 0, 0)
    xr = NumpyOps.act_quant(NumpyOps.rms_norm(x, nw, EPS)[None], kind)[0].astype(np.float64)
    assert np.allclose(y, w @ xr, rtol=1e-3, atol=1e-3 * np.abs(w) @ np.abs(xr))


@pytest.mark.parametrize("t", ["F16", "Q4_0", "Q4_K", "Q6_K"])
def test_float_gate_up(mod: HostModule, t: str) -> None:
    """`dgemv_<T>` with epilogue 2: y[r] = silu(gate row r . x) x (up row r + F . x)."""
    rng = np.random.default_rng(TYPES.index(t))
    f = 13
    w_buf, w, nb = weights(rng, t, 2 * f)
    x = rng.standard_normal(COLS).astype(np.float32)
    y = np.zeros(f, np.float32)
    mod.launch(f"dgemv_{t}", 2, 256, w_buf, nb, f, COLS, x, None, np.float32(EPS), 0, y, None, 2, f)
    g, u = w[:f] @ x, w[f:] @ x
    assert np.allclose(y, g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-4 * np.abs(w[:f]) @ np.abs(x) * np.abs(u))


@pytest.mark.parametrize("t", TYPES)
def test_embedding_row(mod: HostModule, t: str) -> None:
    """`embed_<T>` writes the dequantized row of the token in ids[0], scaled."""
    rng = np.random.default_rng(TYPES.index(t))
    w_buf, w, nb = weights(rng, t, 9)
    ids = np.array([6, 0, 0, 0], np.int32)
    x = np.zeros(COLS, np.float32)
    mod.launch(f"embed_{t}", 1, 32, w_buf, nb, ids, x, COLS, np.float32(2.0))
    assert np.allclose(x, 2.0 * w[6], rtol=1e-6, atol=1e-7)


def test_argmax_first_index_over_blocks(mod: HostModule) -> None:
    """`argmax_ids` puts the index of the largest value in ids[2], the first one on ties, across
    4 blocks, and resets its counter."""
    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    x[[777, 4321]] = 9.0
    bv, bi, counter, ids = np.zeros(4, np.float32), np.zeros(4, np.int32), np.zeros(1, np.int32), np.zeros(4, np.int32)
    mod.launch("argmax_ids", 4, 256, x, x.size, bv, bi, counter, ids)
    assert ids[2] == 777 and counter[0] == 0


def test_add_rmsnorm_and_glu(mod: HostModule) -> None:
    """`add_rmsnorm`: x += rms_norm(t) w; `glu`: y = act(g) u, SiLU or GELU (tanh)."""
    rng = np.random.default_rng(3)
    x, t, w = (rng.standard_normal(COLS).astype(np.float32) for _ in range(3))
    x0 = x.copy()
    mod.launch("add_rmsnorm", 1, 256, x, t, w, COLS, np.float32(EPS))
    assert np.allclose(x, x0 + NumpyOps.rms_norm(t, w, EPS), rtol=1e-5, atol=1e-6)
    gu = rng.standard_normal(2 * COLS).astype(np.float32)
    g, u = gu[:COLS].astype(np.float64), gu[COLS:].astype(np.float64)
    for gelu, want in (
        (0, g / (1 + np.exp(-g)) * u),
        (1, 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g**3))) * u),
    ):
        y = np.zeros(COLS, np.float32)
        mod.launch("glu", 2, 256, gu, y, COLS, gelu)
        assert np.allclose(y, want, rtol=1e-5, atol=1e-6), gelu
