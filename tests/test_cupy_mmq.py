"""CuPy prefill GEMMs that read the GGUF blocks (`mmq_h_<T>`, `mmq_w_<T>`): W @ x of every stored
type equals the float64 product of the fp16-rounded weights and inputs, for ragged rows, tokens and
K, with the same bits from both tile widths; the backend's matmul with them equals the
dequantized-tiles + cuBLAS path and allocates no tile.

Runs only where CuPy and a CUDA device of compute capability 8.0+ work; skipped cleanly elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

from engine.backends import cupy_backend  # noqa: E402
from engine.backends.cupy_backend import CupyOps, QWeight  # noqa: E402
from engine.backends.cupy_plan import mmq_device  # noqa: E402
from engine.gguf_file import TensorInfo  # noqa: E402
from engine.kernels.quant_units import TYPES  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.quants import dequantize  # noqa: E402
from engine.quants_encode import quantize  # noqa: E402
from tests.cupy_helpers import rel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not mmq_device(), reason="mma.sync needs sm_80+")]

K_QUANTS = {"Q4_K", "Q5_K", "Q6_K"}


def _weight(rng: np.random.Generator, t: str, rows: int, cols: int) -> np.ndarray:
    """A random [rows, cols] weight as the GGUF reader hands it over (float types as their dtype)."""
    raw = quantize(rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols), t)
    view = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(t)
    return raw.view(view) if view is not None else raw


@pytest.mark.timeout(120)
@pytest.mark.parametrize("t", TYPES)
def test_mmq_equals_the_fp16_product_for_every_type(t: str) -> None:
    """For every stored type, `mmq_h_<T>` and `mmq_w_<T>` over ragged shapes (rows not a multiple
    of 128, tokens not of 64 or 128, K with an odd number of 32-value units where the type allows
    it) write the float64 product of the fp16-rounded weights and inputs into their column slice,
    within fp32 summation, and the same bits as each other; so does K split over 2 or 5 blocks
    (`mmq_sum` adding the slices), more splits than K steps included."""
    rng = np.random.default_rng(11)
    ops = CupyOps(prefill_dtype="float16")
    for rows, cols, n in [(200, 512, 70), (128, 256, 64), (37, 1024, 130), (300, 256, 2), (260, 512, 257)]:
        if t not in K_QUANTS and cols == 256:
            cols = 96  # three units: the last K step holds one unit and zeros
        raw = _weight(rng, t, rows, cols)
        w = ops.weight(TensorInfo("w", t, (rows, cols), raw))
        ops.finish_uploads()
        assert isinstance(w, QWeight)
        x = rng.standard_normal((n, cols), dtype=np.float32)
        wf = dequantize(raw, t, (rows, cols)).astype(np.float16).astype(np.float64)
        ref = x.astype(np.float16).astype(np.float64) @ wf.T
        outs = []
        for bn, splits in ((64, 1), (128, 1), (64, 2), (128, 2), (64, 5)):  # 5 splits of 96 values: 3 empty
            y = cp.full((n, rows + 5), np.nan, dtype=cp.float32)  # wider: only columns 3..3+rows written
            ops._mmq(w, cp.asarray(x.astype(np.float16)), y, 3, bn=bn, splits=splits)
            got = cp.asnumpy(y)
            assert np.isnan(got[:, :3]).all() and np.isnan(got[:, 3 + rows :]).all()
            err = rel(got[:, 3 : 3 + rows], ref)
            assert err < 1e-5, (t, bn, splits, rows, cols, n, err)
            outs.append(got)
        assert np.array_equal(outs[0], outs[1], equal_nan=True), (t, rows, cols, n)


@pytest.mark.timeout(120)
def test_matmul_with_mmq_equals_tiles_and_allocates_no_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """`CupyOps.matmul` on fp16 precision gives the same product with `mmq_h_<T>` as with
    dequantized tiles and cuBLAS (mixed-type pieces, a bias, pieces cut into several tiles);
    chunks longer than `cupy_mmq_tokens` take the tiles, and the mmq path never allocates them."""
    rng = np.random.default_rng(5)
    on = CupyOps(prefill_dtype="float16", options=EngineOptions(cupy_mmq_tokens=77))
    off = CupyOps(prefill_dtype="float16", options=EngineOptions(cupy_mmq=False))
    long = CupyOps(prefill_dtype="float16", options=EngineOptions(cupy_mmq_tokens=76))
    assert on.mmq and not off.mmq and long.mmq
    parts = [("Q4_K", 1024), ("Q6_K", 256), ("Q8_0", 320)]
    raws = [(_weight(rng, t, r, 1024), t, r) for t, r in parts]
    bias = rng.standard_normal(1600, dtype=np.float32)
    x = cp.asarray(rng.standard_normal((77, 1024), dtype=np.float32))
    # a 300-row tile buffer: the Q4_K piece in 4 tiles of 256 rows, the Q8_0 one in 256 + 64
    monkeypatch.setattr(cupy_backend, "SCRATCH_ELEMS", 300 * 1024)
    outs = []
    for ops in (on, off, long):
        pieces = [ops.weight(TensorInfo("w", t, (r, 1024), raw)) for raw, t, r in raws]
        w = ops.concat_rows([p for p in pieces if isinstance(p, QWeight)])
        ops.finish_uploads()
        assert w.type_name == "mixed" and ops.uses_mmq(w, 77) is (ops is on)
        outs.append(cp.asnumpy(ops.matmul(w, x, cp.asarray(bias))))
    assert rel(outs[0], outs[1]) < 1e-5 and rel(outs[0], outs[2]) < 1e-5
    assert on._scratch is None and off._scratch is not None and long._scratch is not None
    assert long._scratch.nbytes == 300 * 1024 * 2  # fp16 tiles, at most SCRATCH_ELEMS values


@pytest.mark.timeout(120)
def test_int8_rounding_is_the_q8_k_rounding_as_integers() -> None:
    """`act_q8_k_i8` gives int8 values whose products with their scales are `act_quant(x, "q8_k")`'s
    values exactly, and the sum of each 32 of them."""
    rng = np.random.default_rng(3)
    x = cp.asarray(rng.standard_normal((37, 1024), dtype=np.float32) * 4)
    q, d, s = CupyOps.act_q8_k_i8(x)
    want = cp.asnumpy(CupyOps.act_quant(x, "q8_k"))
    qn, dn = cp.asnumpy(q).astype(np.float32), cp.asnumpy(d)
    assert np.array_equal(qn * np.repeat(dn, 256, axis=1), want)
    assert np.array_equal(cp.asnumpy(s), qn.reshape(37, 32, 32).sum(axis=2).astype(np.int32))


@pytest.mark.timeout(120)
def test_int8_mmq_equals_the_product_of_the_rounded_chunk() -> None:
    """`mmq_i8_Q4_K` over ragged rows and tokens, with K split or not, writes into its column slice
    the float64 product of the dequantized Q4_K weight and the q8_k-rounded chunk, within fp32
    summation (its integer sums are exact)."""
    rng = np.random.default_rng(13)
    ops = CupyOps(prefill_dtype="float16", options=EngineOptions(cupy_mmq_i8=True))
    for rows, cols, n in [(200, 512, 70), (128, 256, 64), (37, 1024, 130), (300, 2560, 2), (260, 512, 257)]:
        raw = _weight(rng, "Q4_K", rows, cols)
        w = ops.weight(TensorInfo("w", "Q4_K", (rows, cols), raw))
        ops.finish_uploads()
        x = cp.asarray(rng.standard_normal((n, cols), dtype=np.float32))
        ref = cp.asnumpy(CupyOps.act_quant(x, "q8_k")).astype(np.float64) @ dequantize(raw, "Q4_K", (rows, cols)).T
        for split in (False, True):
            ops.mmq_split = split
            y = cp.full((n, rows + 5), np.nan, dtype=cp.float32)
            ops._mmq_i8(w, CupyOps.act_q8_k_i8(x), y, 3)
            got = cp.asnumpy(y)
            assert np.isnan(got[:, :3]).all() and np.isnan(got[:, 3 + rows :]).all()
            err = rel(got[:, 3 : 3 + rows], ref)
            assert err < 1e-5, (split, rows, cols, n, err)


@pytest.mark.timeout(120)
def test_matmul_with_int8_q4_k_pieces_agrees_with_fp16() -> None:
    """With `cupy_mmq_i8`, a mixed QKV-like matrix (Q4_K run + Q6_K piece, bias) multiplies its Q4_K
    rows in int8 and the rest in fp16: the product agrees with the all-fp16 one within fp16's
    rounding and equals the float64 product of the rounded inputs per piece; a chunk not rounded to
    q8_k (aq None) stays fp16 throughout."""
    rng = np.random.default_rng(21)
    on = CupyOps(prefill_dtype="float16", options=EngineOptions(cupy_mmq_i8=True))
    off = CupyOps(prefill_dtype="float16")
    assert on.mmq_i8 and not off.mmq_i8
    parts = [("Q4_K", 384), ("Q4_K", 128), ("Q6_K", 128)]
    raws = [(_weight(rng, t, r, 1024), t, r) for t, r in parts]
    bias = rng.standard_normal(640, dtype=np.float32)
    x = cp.asarray(rng.standard_normal((77, 1024), dtype=np.float32))
    outs = {}
    for name, ops in (("on", on), ("off", off)):
        w = ops.weight_rows([TensorInfo("w", t, (r, 1024), raw) for raw, t, r in raws])
        ops.finish_uploads()
        outs[name] = cp.asnumpy(ops.matmul(w, x, cp.asarray(bias), aq="q8_k"))
        outs[name + "_plain"] = cp.asnumpy(ops.matmul(w, x, cp.asarray(bias)))
    xr = cp.asnumpy(CupyOps.act_quant(x, "q8_k")).astype(np.float64)
    wq4 = np.concatenate([dequantize(raw, t, (r, 1024)) for raw, t, r in raws[:2]])
    assert rel(outs["on"][:, :512], xr @ wq4.T + bias[:512]) < 1e-5
    assert rel(outs["on"], outs["off"]) < 2e-3
    assert np.array_equal(outs["on"][:, 512:], outs["off"][:, 512:])  # the Q6_K piece: fp16 in both
    assert np.array_equal(outs["on_plain"], outs["off_plain"])
