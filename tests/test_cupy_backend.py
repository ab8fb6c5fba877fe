"""CuPy backend: every kernel against its NumPy twin, whole models against the NumPy backend.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

from engine import load_model  # noqa: E402
from engine.backends.cupy_backend import CupyOps, QWeight  # noqa: E402
from engine.backends.numpy_backend import NumpyOps  # noqa: E402
from engine.gguf_file import TensorInfo  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.quants import dequantize, dequantize_rows  # noqa: E402
from engine.quants_encode import quantize  # noqa: E402
from engine.synth import preset_config, write_config, write_synthetic_gguf  # noqa: E402
from tests.cupy_helpers import MODEL_CASES, SHAPE, rel  # noqa: E402

pytestmark = pytest.mark.gpu

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
ACT = {
    "Q4_0": "q8_0",
    "Q4_1": "q8_0",
    "Q5_0": "q8_0",
    "Q5_1": "q8_0",
    "Q8_0": "q8_0",
    "Q4_K": "q8_k",
    "Q5_K": "q8_k",
    "Q6_K": "q8_k",
}


@pytest.fixture(scope="module")
def ops() -> CupyOps:
    return CupyOps(prefill_dtype="float32")  # exact tiles: these tests bound errors at ~1e-5


EXACT = EngineOptions(cupy_prefill="float32")
"""Models loaded here prefill with fp32 tiles (the exactness bounds below are fp32's; the
default "auto" tiles are checked in tests/test_cupy_prefill.py)."""


def _rng() -> np.random.Generator:
    return np.random.default_rng(17)  # seeded: the same inputs on every run, so a failure reproduces


def _tensor(t: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[TensorInfo, np.ndarray]:
    raw = quantize(rng.standard_normal((rows, cols), dtype=np.float32), t)
    view = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}.get(t)
    raw = raw.view(view) if view else raw
    return TensorInfo("w", t, (rows, cols), raw), dequantize(raw, t, (rows, cols))


@pytest.mark.parametrize("t", TYPES)
def test_gemv_matches_numpy(ops: CupyOps, t: str) -> None:
    """Fused dequantize+GEMV of each type == dequantize then W @ x (odd row count, bias)."""
    rng = _rng()
    info, w = _tensor(t, 77, 768, rng)
    x = rng.standard_normal((1, 768), dtype=np.float32)
    b = rng.standard_normal(77, dtype=np.float32)
    y = ops.linear(cp.asarray(x), ops.weight(info), cp.asarray(b))
    assert rel(cp.asnumpy(y), w @ x[0] + b) < 1e-5


@pytest.mark.parametrize("t", TYPES)
def test_prefill_matmul_and_dequant_match_numpy(ops: CupyOps, t: str) -> None:
    """fp16 tiles + cuBLAS for T > 1; dequantize-to-fp16 and row gather against engine.quants."""
    rng = _rng()
    info, w = _tensor(t, 131, 512, rng)
    x = rng.standard_normal((5, 512), dtype=np.float32)
    qw = ops.weight(info)
    assert rel(cp.asnumpy(ops.linear(cp.asarray(x), qw)), x @ w.T) < 1e-5
    half = CupyOps(prefill_dtype="float16")
    assert rel(cp.asnumpy(half.linear(cp.asarray(x), qw)), x @ w.T) < 2e-3
    out = cp.empty((131, 512), dtype=cp.float16)
    ops.dequant_f16(qw, 0, 131, out)
    assert rel(cp.asnumpy(out).astype(np.float32), w) < 1e-3
    out32 = cp.empty((128, 512), dtype=cp.float32)
    ops.dequant_f32(qw, 3, 131, out32)
    np.testing.assert_allclose(cp.asnumpy(out32), w[3:131], rtol=1e-6, atol=1e-6)
    ids = np.array([130, 0, 7, 7, 64])
    rows = cp.asnumpy(ops.embed_rows(qw, ids, 512))
    np.testing.assert_allclose(rows, dequantize_rows(info.raw, t, ids, 512), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_prefill_gemm_tiles_write_in_place(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several scratch tiles over a mixed-type weight: each GemmEx writes its own output columns."""
    from engine.backends import cupy_backend

    monkeypatch.setattr(cupy_backend, "SCRATCH_ELEMS", 512 * 40)  # 40-row tiles
    rng = _rng()
    a, wa = _tensor("Q4_K", 97, 512, rng)
    b, wb = _tensor("Q6_K", 45, 512, rng)
    ops = CupyOps(prefill_dtype=dtype, options=EngineOptions(cupy_mmq=False))  # tiles, not mmq_h_<T>
    w = ops.concat_rows([ops.weight(a), ops.weight(b)])
    x = rng.standard_normal((9, 512), dtype=np.float32)
    bias = rng.standard_normal(142, dtype=np.float32)
    y = cp.asnumpy(ops.linear(cp.asarray(x), w, cp.asarray(bias)))
    ref = x.astype(np.float64) @ np.concatenate([wa, wb]).T.astype(np.float64) + bias
    assert rel(y, ref) < (2e-3 if dtype == "float16" else 1e-5)
    assert ops._gemm_ok == {dtype == "float16": True}  # GemmEx used (agreed with cp.matmul)


def test_mixed_type_concat_runs_each_piece(ops: CupyOps) -> None:
    rng = _rng()
    a, wa = _tensor("Q4_K", 33, 512, rng)
    b, wb = _tensor("Q6_K", 17, 512, rng)
    w = ops.concat_rows([ops.weight(a), ops.weight(b)])
    assert isinstance(w, QWeight) and w.shape == (50, 512) and len(w.parts) == 2
    x = rng.standard_normal((1, 512), dtype=np.float32)
    ref = np.concatenate([wa, wb]) @ x[0]
    assert rel(cp.asnumpy(ops.linear(cp.asarray(x), w))[0], ref) < 1e-5
    x3 = rng.standard_normal((3, 512), dtype=np.float32)
    assert rel(cp.asnumpy(ops.linear(cp.asarray(x3), w)), x3 @ np.concatenate([wa, wb]).T) < 1e-5


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K"), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q4_K", "Q4_K", "Q6_K")])
def test_weight_rows_equals_concat_rows(ops: CupyOps, types: tuple[str, ...]) -> None:
    """Tensors uploaded straight into their stacked buffer give the same runs, bytes and products as
    uploading each and concatenating."""
    rng = _rng()
    made = [_tensor(t, 16 + 8 * i, 512, rng) for i, t in enumerate(types)]
    ts = [t for t, _ in made]
    fused = ops.weight_rows(ts)
    ref = ops.concat_rows([ops.weight(t) for t in ts])
    ops.finish_uploads()
    assert fused.shape == ref.shape == (sum(t.shape[0] for t in ts), 512)
    assert [(p.type_name, p.shape) for p in fused.pieces()] == [(p.type_name, p.shape) for p in ref.pieces()]
    for a, b in zip(fused.pieces(), ref.pieces(), strict=True):
        assert cp.array_equal(a.raw, b.raw)
    x = rng.standard_normal((3, 512), dtype=np.float32)
    want = x.astype(np.float64) @ np.concatenate([w for _, w in made]).T
    assert rel(cp.asnumpy(ops.linear(cp.asarray(x), fused)), want) < 1e-5


def test_weight_rows_from_a_file_are_read_at_finish(ops: CupyOps, tmp_path: Path) -> None:
    """Tensors mapped from a file (as a model's are) are read when the uploads finish: their stacked
    buffer then holds the file's bytes, and a product asked for before `finish_uploads` finishes
    them first."""
    from engine.gguf_file import file_identity

    rng = _rng()
    made = [_tensor(t, 16, 512, rng) for t in ("Q4_K", "Q4_K", "Q6_K")]
    blob = b"".join(np.ascontiguousarray(t.raw).tobytes() for t, _ in made)
    path = tmp_path / "w.bin"
    path.write_bytes(b"0123" + blob)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    ident, off, ts = file_identity(str(path)), 4, []
    for t, _ in made:
        n = t.raw.nbytes
        ts.append(TensorInfo("w", t.type_name, t.shape, mapped[off : off + n].reshape(t.shape[0], -1), off, ident))
        off += n
    fused = ops.weight_rows(ts)
    x = rng.standard_normal((3, 512), dtype=np.float32)
    got = cp.asnumpy(ops.linear(cp.asarray(x), fused))  # before finish_uploads: settles them first
    want = x.astype(np.float64) @ np.concatenate([w for _, w in made]).T
    assert rel(got, want) < 1e-5
    ref = ops.weight_rows([t for t, _ in made])
    ops.finish_uploads()
    for a, b in zip(fused.pieces(), ref.pieces(), strict=True):
        assert cp.array_equal(a.raw, b.raw)


@pytest.mark.parametrize("kind", ["q8_0", "q8_k"])
def test_act_quant_matches_numpy(ops: CupyOps, kind: str) -> None:
    x = _rng().standard_normal((3, 1024), dtype=np.float32) * 3
    got = cp.asnumpy(ops.act_quant(cp.asarray(x), kind))
    ref = NumpyOps.act_quant(x, kind)
    assert np.mean(np.abs(got - ref) > 1e-6) < 1e-3  # a rare tie may round the other way
    half = ops.act_quant(cp.asarray(x), kind, half=True)  # rounded and converted in one launch
    assert half.dtype == cp.float16 and half.flags.c_contiguous
    assert np.array_equal(cp.asnumpy(half), cp.asnumpy(ops.act_quant(cp.asarray(x), kind).astype(cp.float16)))
    assert np.array_equal(cp.asnumpy(ops.act_quant(cp.asarray(x), None, half=True)), x.astype(np.float16))


@pytest.mark.parametrize("n", [64, 576, 2560, 77 * 32])
def test_rms_norm(ops: CupyOps, n: int) -> None:
    rng = _rng()
    x = rng.standard_normal((3, 5, n), dtype=np.float32)
    w = rng.standard_normal(n, dtype=np.float32)
    got = cp.asnumpy(ops.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6))
    np.testing.assert_allclose(got, NumpyOps.rms_norm(x, w, 1e-6), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dim", [64, 32])
def test_rope(ops: CupyOps, style: str, dim: int) -> None:
    """Both styles; dim < head size rotates only the first `dim` values."""
    x = _rng().standard_normal((7, 3, 64), dtype=np.float32)
    cos, sin = NumpyOps.rope_tables(50, dim, 10000.0, 1.0)
    ccos, csin = ops.rope_tables(50, dim, 10000.0, 1.0)
    got = cp.asnumpy(ops.rope(cp.asarray(x), ccos[40:47], csin[40:47], style))
    np.testing.assert_allclose(got, NumpyOps.rope(x, cos[40:47], sin[40:47], style), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dim,norm", [(128, True), (64, True), (128, False)])
def test_norm_rope_reads_the_qkv_columns_in_place(ops: CupyOps, style: str, dim: int, norm: bool) -> None:
    """`norm_rope` on the key heads of a fused QKV output (a strided view) gives exactly what
    `rms_norm` then `rope` give on a copy (same arithmetic: equal to float rounding), with and
    without the norm, for partial rotation too."""
    rng = _rng()
    t, nh, nkv, d = 9, 4, 2, 128
    qkv = cp.asarray(rng.standard_normal((t, (nh + 2 * nkv) * d), dtype=np.float32))
    k = qkv[:, nh * d : (nh + nkv) * d].reshape(t, nkv, d)
    w = cp.asarray(rng.standard_normal(d, dtype=np.float32)) if norm else None
    cos, sin = ops.rope_tables(64, dim, 10000.0, 1.0)
    c, s = cos[30 : 30 + t], sin[30 : 30 + t]
    got = ops.norm_rope(k, w, 1e-6, c, s, style)
    want = ops.rope(k if w is None else ops.rms_norm(k, w, 1e-6), c, s, style)
    assert got.shape == (t, nkv, d) and got.flags.c_contiguous
    np.testing.assert_allclose(cp.asnumpy(got), cp.asnumpy(want), rtol=1e-6, atol=1e-7)
    ref = NumpyOps.norm_rope(
        NumpyOps(), cp.asnumpy(k), None if w is None else cp.asnumpy(w), 1e-6, cp.asnumpy(c), cp.asnumpy(s), style
    )
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("t,start", [(1, 0), (1, 37), (6, 20)])
def test_attention(ops: CupyOps, kv_dtype: str, window: int, t: int, start: int) -> None:
    """GQA (8 heads over 2 KV heads), decode kernel (t == 1) and prefill path, sliding window."""
    rng = _rng()
    n_ctx, d = 64, 128
    k = rng.standard_normal((2, n_ctx, d)).astype(kv_dtype)
    v = rng.standard_normal((2, n_ctx, d)).astype(kv_dtype)
    q = rng.standard_normal((t, 8, d), dtype=np.float32)
    ref = NumpyOps.attention(q, k, v, start, window, 0.088)
    got = ops.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), start, window, 0.088)
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_gated_act(ops: CupyOps, kind: str) -> None:
    gu = _rng().standard_normal((3, 2 * 333), dtype=np.float32) * 3
    got = ops.gated_act(cp.asarray(gu)[:, :333], cp.asarray(gu)[:, 333:], kind)
    np.testing.assert_allclose(
        cp.asnumpy(got), NumpyOps.gated_act(gu[:, :333], gu[:, 333:], kind), rtol=1e-5, atol=1e-5
    )


def test_argmax_on_device(ops: CupyOps) -> None:
    x = _rng().standard_normal(151936, dtype=np.float32)
    assert ops.argmax(cp.asarray(x)) == int(np.argmax(x))
    x[[5, 9]] = 100.0  # ties: the first index, as numpy
    assert ops.argmax(cp.asarray(x)) == 5


@pytest.mark.parametrize("arch,t,extra", MODEL_CASES)
def test_model_logits_match_numpy(tmp_path: Path, arch: str, t: str, extra: dict, act_mode: str) -> None:
    """Teacher-forced argmax agrees >= 99.5% (prefill path), decode steps agree too."""
    exact = act_mode == "exact" or t in ("F32", "F16", "BF16")
    kw = {**SHAPE, **extra}
    p = write_synthetic_gguf(tmp_path / "m.gguf", arch, weight_type=t, seed=7, **kw)
    ids = np.random.default_rng(3).integers(0, SHAPE["n_vocab"], 300).tolist()
    ref = load_model(p, backend="numpy", n_ctx=512, kv_dtype="f16", options=EXACT)
    gpu = load_model(p, backend="cupy", n_ctx=512, kv_dtype="f16", options=EXACT)
    assert gpu.backend == "cupy"
    a, b = gpu.logits(ids), ref.logits(ids)
    assert np.isfinite(a).all()
    agree = float(np.mean(a.argmax(1) == b.argmax(1)))
    assert agree >= (0.995 if exact else 0.95), (agree, rel(a, b))
    assert rel(a, b) < (1e-3 if exact else 4e-2)
    # decode path (one token at a time through the GEMV kernels), vs the prefill logits
    gpu.transformer.kv.tokens = []
    steps = np.stack([gpu.step_logits([tok], i) for i, tok in enumerate(ids[:40])])
    assert float(np.mean(steps.argmax(1) == b[:40].argmax(1))) >= (0.975 if exact else 0.9)
    assert rel(steps, b[:40]) < (1e-3 if exact else 4e-2)


def test_greedy_generation_identical_on_smollm2_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """64 greedy tokens on a SmolLM2-135M-shaped Q4_1 model: CuPy == NumPy (activation
    rounding off: with it on, the two diverge after ~20-40 tokens on random weights; see act_mode)."""
    import engine.model

    monkeypatch.setattr(engine.model, "ACT_QUANT", {})
    p = write_config(tmp_path / "smol.gguf", preset_config("smollm2-135m-q4_1", seed=11))
    prompt = np.random.default_rng(5).integers(0, 49152, 24).tolist()
    outs = []
    for backend in ("numpy", "cupy"):
        m = load_model(
            p, backend=backend, n_ctx=256, kv_dtype="f32", options=EXACT
        )  # f16 rounding could flip a close call
        tf = m.transformer
        tf.kv.tokens = []
        logits = tf.ops.to_host(tf.forward(prompt, 0, last_n=1))[0]
        toks, pos = [], len(prompt)
        for _ in range(64):
            nxt = int(np.argmax(logits))
            toks.append(nxt)
            logits = tf.ops.to_host(tf.forward([nxt], pos, last_n=1))[0]
            pos += 1
        outs.append(toks)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_kv_store_int8_matches_host_rule(ops: CupyOps, d: int) -> None:
    """An int8 cache written on the GPU (`kv_store_int8`) holds exactly the values and scales of
    the host rule (`engine.kv_cache.quantize_rows`), at the right positions, nothing else."""
    from engine.kv_cache import Int8Rows, quantize_rows

    rng = np.random.default_rng(18)
    t, kv, n_ctx, start = 37, 3, 96, 11
    x = (rng.standard_normal((t, kv, d)) * rng.uniform(0.01, 10, (t, kv, 1))).astype(np.float32)
    x[0, 0, :32] = 0.0  # an all-zero block: scale 0, values 0
    cache = Int8Rows(cp.zeros((kv, n_ctx, d), cp.int8), cp.zeros((kv, n_ctx, d // 32), cp.float16))
    ops.kv_store(cache, start, cp.asarray(x))
    want_q, want_d = quantize_rows(np, x.transpose(1, 0, 2))
    got_q, got_d = cp.asnumpy(cache.q), cp.asnumpy(cache.d)
    assert np.array_equal(got_q[:, start : start + t], want_q)
    assert np.array_equal(got_d[:, start : start + t], want_d)
    assert not got_q[:, :start].any() and not got_q[:, start + t :].any()
    assert not got_d[:, :start].any() and not got_d[:, start + t :].any()
