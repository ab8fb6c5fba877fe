"""CuPy prefill: fp16 tensor-core tiles (what prefill_dtype "auto" uses for large matrices) keep
teacher-forced argmax agreement with the NumPy backend; attention in blocks of query rows equals
NumPy's; the tile precision each matrix gets.

Runs only where CuPy and a CUDA device work (`pytest -m gpu`); skipped cleanly elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.gpu import require_cuda

cp = require_cuda()

from engine import load_model  # noqa: E402
from engine.backends import cupy_plan  # noqa: E402
from engine.backends.cupy_backend import CupyOps, QWeight  # noqa: E402
from engine.backends.numpy_backend import NumpyOps  # noqa: E402
from engine.kv_cache import Int8Rows, quantize_rows  # noqa: E402
from engine.options import EngineOptions  # noqa: E402
from engine.synth import write_synthetic_gguf  # noqa: E402
from tests.cupy_helpers import MODEL_CASES, SHAPE, rel  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch,t,extra", MODEL_CASES)
def test_fp16_tiles_keep_teacher_forced_argmax(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, t: str, extra: dict
) -> None:
    """Prefill with fp16 tiles for every matrix (what "auto" picks for matrices of >= 4M values;
    these small ones would get fp32) agrees with the NumPy backend on >= 99.5 % of the
    teacher-forced argmaxes, activation rounding off (relative error ~1.1e-3, against fp32
    tiles' < 1e-3: tests/test_cupy_backend.py)."""
    import engine.model

    monkeypatch.setattr(engine.model, "ACT_QUANT", {})
    p = write_synthetic_gguf(tmp_path / "m.gguf", arch, weight_type=t, seed=7, **{**SHAPE, **extra})
    ids = np.random.default_rng(3).integers(0, SHAPE["n_vocab"], 300).tolist()
    gpu = load_model(p, backend="cupy", n_ctx=512, kv_dtype="f16", options=EngineOptions(cupy_prefill="float16"))
    assert gpu.transformer.ops.prefill_dtype == "float16"
    a = gpu.logits(ids)
    b = load_model(p, backend="numpy", n_ctx=512, kv_dtype="f16").logits(ids)
    agree = float(np.mean(a.argmax(1) == b.argmax(1)))
    print(f"{arch} {t}: fp16 tiles agree {agree:.4f}, relative error {rel(a, b):.2e}")
    assert np.isfinite(a).all()
    assert agree >= 0.995, (agree, rel(a, b))
    assert rel(a, b) < 5e-3


def test_auto_tiles_by_matrix_size() -> None:
    """auto: a matrix of >= 4M values gets fp16 tiles (GemmEx on tensor cores), a small one and
    a stored BF16 one fp32; the result is W @ x within each precision's error."""
    from engine.gguf_file import TensorInfo
    from engine.quants import dequantize
    from engine.quants_encode import quantize

    rng = np.random.default_rng(75)
    ops = CupyOps(prefill_dtype="auto")
    for rows, cols, t, want in [
        (2048, 2048, "Q4_K", "float16"),
        (512, 256, "Q4_K", "float32"),
        (2048, 2048, "BF16", "float32"),
    ]:
        raw = quantize(rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols), t)
        raw = raw.view(np.uint16) if t == "BF16" else raw
        info = TensorInfo("w", t, (rows, cols), raw)
        w = ops.weight(info)
        assert isinstance(w, QWeight) and ops.tile_dtype(w) == want
        x = rng.standard_normal((9, cols), dtype=np.float32)
        ref = x.astype(np.float64) @ dequantize(raw, t, (rows, cols)).T.astype(np.float64)
        got = cp.asnumpy(ops.linear(cp.asarray(x), w))
        assert rel(got, ref) < (2e-3 if want == "float16" else 1e-5), (t, rows, rel(got, ref))


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("t,start,window", [(37, 10, 0), (37, 10, 7), (64, 0, 0), (13, 40, 9)])
def test_blocked_prefill_attention_matches_numpy(
    monkeypatch: pytest.MonkeyPatch, kv_dtype: str, t: int, start: int, window: int
) -> None:
    """With a score block too small for the chunk (rows processed in several blocks), prefill
    attention (GQA 6 heads over 2, sliding window) equals NumpyOps.attention; the score buffer
    has the planned size."""
    monkeypatch.setattr(cupy_plan, "ATTN_SCORES_BYTES", 2 * 64 * 4 * 5)  # 5 rows of 64 keys
    rng = np.random.default_rng(99)
    n_ctx, d = 128, 64
    k = rng.standard_normal((2, n_ctx, d)).astype(np.float32)
    v = rng.standard_normal((2, n_ctx, d)).astype(np.float32)
    q = rng.standard_normal((t, 6, d), dtype=np.float32)
    kr: Any
    vr: Any
    if kv_dtype == "int8":
        kq, vq = quantize_rows(np, k), quantize_rows(np, v)
        kc: Any = Int8Rows(cp.asarray(kq[0]), cp.asarray(kq[1]))
        vc: Any = Int8Rows(cp.asarray(vq[0]), cp.asarray(vq[1]))
        kr, vr = Int8Rows(*kq), Int8Rows(*vq)
    else:
        kr, vr = k.astype(kv_dtype), v.astype(kv_dtype)
        kc, vc = cp.asarray(kr), cp.asarray(vr)
    ops = CupyOps(prefill_dtype="float32")
    got = ops.attention(cp.asarray(q), kc, vc, start, window, 0.125)
    ref = NumpyOps.attention(q, kr, vr, start, window, 0.125)
    np.testing.assert_allclose(cp.asnumpy(got), ref, rtol=1e-4, atol=1e-5)
    assert ops._attn is not None and ops._attn.scores.size == cupy_plan.score_elems(2, n_ctx, 3)
    ops.attn_tf32 = True  # what a model whose matrices multiply in fp16 gets
    fast = cp.asnumpy(ops.attention(cp.asarray(q), kc, vc, start, window, 0.125))
    err = float(np.abs(fast - ref).max())
    assert err < 1e-2, err  # TF32 inputs (10-bit mantissa) where cuBLAS takes the tensor cores


def test_attention_precision_follows_the_models_products(tmp_path: Path) -> None:
    """A model whose QKV multiplies in fp16 precision gets TF32 prefill attention; under the
    "float32" precision (what the exact whole-model tests pin) attention stays fp32."""
    p = write_synthetic_gguf(tmp_path / "m.gguf", "llama", weight_type="Q4_1", seed=4, **SHAPE)
    fast = load_model(p, backend="cupy", n_ctx=64, options=EngineOptions(cupy_prefill="float16"))
    exact = load_model(p, backend="cupy", n_ctx=64, options=EngineOptions(cupy_prefill="float32"))
    assert fast.transformer.ops.attn_tf32 and not exact.transformer.ops.attn_tf32


def test_a_large_models_long_first_chunks_replay_a_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model above GRAPH_MAX_WEIGHTS replays first chunks longer than `cupy_mmq_tokens` (tiles +
    cuBLAS) from one graph with the eager pass's logits (within fp16 summation order), and runs
    shorter ones, and every chunk prefilled in layer groups (a pause between two), eagerly."""
    import engine.model

    monkeypatch.setattr(engine.model, "ACT_QUANT", {})
    monkeypatch.setattr(cupy_plan, "GRAPH_MAX_WEIGHTS", 1)  # this small model counts as large
    p = write_synthetic_gguf(tmp_path / "m.gguf", "llama", weight_type="Q4_K", seed=4, **{**SHAPE, "n_layers": 2})
    opts = EngineOptions(cupy_prefill="float16", cupy_mmq_tokens=64)
    m = load_model(p, backend="cupy", n_ctx=256, kv_dtype="f32", options=opts)
    tf = m.transformer
    graphs = tf.ops.prefill_graphs
    assert graphs is not None and graphs.buckets == (256,) and graphs.shortest == 65
    assert graphs.bucket_for(64, 0, 1, 256) is None and graphs.bucket_for(65, 0, 1, 256) == 256
    rng = np.random.default_rng(3)
    for t in (40, 100, 200):
        ids = rng.integers(0, 512, t).tolist()
        got = cp.asnumpy(tf.forward(ids, 0, last_n=1))
        want = cp.asnumpy(tf.forward(ids, 0, last_n=1, graph=False))
        # fp16 products: the padded GEMMs (256 rows) may take another cuBLAS kernel (measured 4e-4)
        assert rel(got, want) < 2e-3, (t, rel(got, want))
    assert len(graphs._graphs) == 1  # the 100- and 200-token chunks share one graph; 40 ran eagerly
    assert graphs.grouped_eager and graphs.bucket_for(100, 0, 1, 256, grouped=True) is None
    ids = rng.integers(0, 512, 100).tolist()
    want = cp.asnumpy(tf.forward(ids, 0, last_n=1, graph=False)).reshape(-1)
    p = m.prefill_pass(ids, 0, 1)  # in groups of one layer: eager pieces, not the graph
    assert p is not None
    got = None
    while got is None:
        got = m.prefill_layers(p, 1)
    assert np.array_equal(np.asarray(got).reshape(-1), want)


def test_first_chunk_graph_matches_eager_prefill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's first chunk replayed from a CUDA graph (padded to the chunk) gives the eager
    pass's logits and K/V rows, and prompts of other lengths reuse the same graph. Activation
    rounding off: the padded pass's GEMMs have other shapes, so cuBLAS may sum in another order,
    and a 1e-7 difference can flip a q8 rounding step."""
    import engine.model

    monkeypatch.setattr(engine.model, "ACT_QUANT", {})
    p = write_synthetic_gguf(tmp_path / "m.gguf", "llama", weight_type="Q4_1", seed=4, **{**SHAPE, "n_layers": 2})
    rng = np.random.default_rng(3)
    m = load_model(p, backend="cupy", n_ctx=256, kv_dtype="f32", options=EngineOptions(cupy_prefill="float32"))
    tf = m.transformer
    graphs = tf.ops.prefill_graphs
    assert graphs is not None and graphs.buckets == (256,) and graphs.shortest == 2 and not graphs.grouped_eager
    assert graphs.bucket_for(50, 0, 1, 256, grouped=True) == 256  # a small model's chunk: one piece
    for t in (37, 50, 64, 100):
        ids = rng.integers(0, 512, t).tolist()
        got = cp.asnumpy(tf.forward(ids, 0, last_n=1))
        k_got = cp.asnumpy(tf.kv.k[1][:, :t])
        want = cp.asnumpy(tf.forward(ids, 0, last_n=1, graph=False))
        k_want = cp.asnumpy(tf.kv.k[1][:, :t])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(k_got, k_want, rtol=1e-5, atol=1e-5)
    assert len(graphs._graphs) == 1 and not graphs.failed  # one graph served every length
    assert graphs.held_bytes > 0


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_later_chunk_graphs_match_eager_prefill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kv: str) -> None:
    """A chunk after a cached prefix is replayed from graphs keyed by padded length, start and
    layer group - captured at a start's second sighting, or its first once `expect` named it,
    never before an eager prefill ran - and gives the eager pass's logits and K/V, whole or in
    layer groups through `Model.prefill_pass`; at most LATER_KEEP graphs are kept."""
    import engine.model
    from engine.backends.cupy_prefill_graph import LATER_KEEP

    monkeypatch.setattr(engine.model, "ACT_QUANT", {})  # padded shapes: see the first-chunk test
    p = write_synthetic_gguf(tmp_path / "m.gguf", "llama", weight_type="Q4_1", seed=5, **{**SHAPE, "n_layers": 4})
    rng = np.random.default_rng(6)
    m = load_model(p, backend="cupy", n_ctx=512, kv_dtype=kv, options=EngineOptions(cupy_prefill="float32"))
    tf = m.transformer
    graphs = tf.ops.prefill_graphs
    assert graphs is not None and graphs.later_max == 128
    assert not tf.ops.prefill_warm()
    graphs.expect(40)
    assert tf.begin_replay([1, 2, 3], 40, 0) is None  # no eager prefill yet: nothing captured
    prefix = rng.integers(0, 512, 40).tolist()
    tf.forward(prefix, 0, last_n=1, graph=False)
    assert tf.ops.prefill_warm()

    def keys(start: int, t: int) -> np.ndarray:
        k = tf.kv.k[3] if kv == "f32" else tf.kv.k[3].q
        return np.asarray(cp.asnumpy(k[:, start : start + t]), dtype=np.float32)

    def both(ids: list[int], start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        got = cp.asnumpy(tf.forward(ids, start, last_n=1))
        k_got = keys(start, len(ids))
        want = cp.asnumpy(tf.forward(ids, start, last_n=1, graph=False))
        return got, want, k_got, keys(start, len(ids))

    # int8 K/V: a padded GEMM's last-bit difference can move a value across a rounding step, and
    # the attention reading that row moves the logits by ~1e-4 (measured 3.7e-4 at most)
    tol = 1e-4 if kv == "f32" else 2e-3
    for n_graphs, t in ((1, 20), (1, 30), (2, 50)):  # expected start: captured at once; 20 and 30 share 32 rows
        got, want, k_got, k_want = both(rng.integers(0, 512, t).tolist(), 40)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=tol)
        np.testing.assert_allclose(k_got, k_want, rtol=1e-5, atol=1 if kv == "int8" else 1e-5)
        assert len(graphs._later) == n_graphs
    tf.forward(rng.integers(0, 512, 60).tolist(), 40, last_n=1, graph=False)  # rows 40..99 for the next start
    q = rng.integers(0, 512, 24).tolist()
    first = cp.asnumpy(tf.forward(q, 100, last_n=1))  # a start not seen before: eager, remembered
    assert len(graphs._later) == 2
    got, want, _, _ = both(q, 100)  # its second sighting: captured
    assert len(graphs._later) == 3
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=tol)
    np.testing.assert_allclose(first, want, rtol=1e-4, atol=tol)

    # in layer groups, through the model (the cache's tokens kept as a generation keeps them)
    prefix += rng.integers(0, 512, 20).tolist()
    m.step_logits(prefix, 0)
    outs = []
    for _ in range(2):
        pas = m.prefill_pass(q, 60, 2)
        assert pas is not None and (pas.replay is not None) == bool(outs)  # seen: the second is replayed
        out = None
        while out is None:
            out = m.prefill_layers(pas, 2)
        outs.append(out)
        assert m.transformer.kv.tokens == prefix + q
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=tol)
    assert len(graphs._later[next(reversed(graphs._later))].graphs) == 2  # two groups of two layers

    for s in range(200, 200 + 4 * (LATER_KEEP + 2), 4):
        graphs.expect(s)
        tf.forward([1, 2, 3], s, last_n=1)
    assert len(graphs._later) == LATER_KEEP and graphs.later_failures == 0
    assert graphs.held_bytes > 0
    full = rng.integers(0, 512, graphs.later_max).tolist()  # as long as a chunk of a long prompt
    for _ in range(2):
        tf.forward(full, 300, last_n=1)
    assert (128, 300) not in {k[:2] for k in graphs._later}  # seen twice, but only a named start takes it
    graphs.expect(300)
    tf.forward(full, 300, last_n=1)
    assert (128, 300) in {k[:2] for k in graphs._later}


def test_later_chunk_graphs_of_a_model_with_its_embedding_on_the_host(tmp_path: Path) -> None:
    """A model with a separate output matrix keeps its token embedding on the host; its later
    chunks are replayed all the same (the embedding runs before the graph) with the eager
    pass's logits."""
    import engine.model

    p = write_synthetic_gguf(tmp_path / "m.gguf", "llama", weight_type="Q8_0", seed=7, tied=False, **SHAPE)
    m = load_model(p, backend="cupy", n_ctx=256, options=EngineOptions(cupy_prefill="float32"))
    tf = m.transformer
    assert isinstance(tf.embed_table, engine.model.TensorInfo)  # on the host
    graphs = tf.ops.prefill_graphs
    rng = np.random.default_rng(8)
    tf.forward(rng.integers(0, 512, 30).tolist(), 0, last_n=1, graph=False)
    graphs.expect(30)
    q = rng.integers(0, 512, 10).tolist()
    got = cp.asnumpy(tf.forward(q, 30, last_n=1))
    assert len(graphs._later) == 1 and graphs.later_failures == 0
    want = cp.asnumpy(tf.forward(q, 30, last_n=1, graph=False))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
