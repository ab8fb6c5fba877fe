"""The decode step's attention kernel (`attn_decode`) on the host (tests/cuda_host.py) equals
softmax attention in float64, both as every GPU below sm_90 runs it (split-K slices merged by the
last block of a KV head) and as sm_90 runs it (thread-block clusters of 8 merging through each
other's shared memory up to 8 x 192 positions, slices past that): f32 / f16 / int8 caches, grouped
queries, one position to many slices, a sliding window, head sizes on the fast lane path and off
it, and the output projection's input rounded in the kernel as `qprep_x` would. Skipped without a
C++20 compiler (failed under CI=true)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.numpy_backend import NumpyOps
from engine.kernels import decode_src
from tests.cuda_host import DecodeModules, HostModule

pytestmark = pytest.mark.timeout(600)

N_CTX = 2048
N_SPLIT = 16
CLUSTER = 8
"""Blocks of a thread-block cluster in the sm_90 build (`EngineOptions.attn_cluster`)."""
SHAPES = {
    "g3-d64": (9, 3, 64),  # SmolLM2's heads: 3 queries a KV head, 64 dims
    "g4-d128": (8, 2, 128),  # Qwen3-4B's group and head size
    "g2-d80": (4, 2, 80),  # a head size off the 8-lanes-a-position path
}
"""name -> (query heads, KV heads, head size)."""
KV_TYPES = ("float32", "float16", "int8")


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> DecodeModules:
    """The decode modules of these tests, built on first use."""
    return DecodeModules(tmp_path_factory)


def module(modules: DecodeModules, shape: str, kv: str, cluster: int = 0) -> HostModule:
    """The decode module of `shape` with a `kv` cache (`cluster`: the sm_90 build's thread-block
    clusters, 0 none)."""
    h, kvh, d = SHAPES[shape]
    return modules.get(n_heads=h, n_kv_heads=kvh, head_dim=d, kv=kv, n_split=N_SPLIT, cluster=cluster)


def cache_of(rng: np.random.Generator, kv: str, kvh: int, d: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """A random [KVH, N_CTX, D] cache as the kernel reads it (values; int8: per-32 f16 scales) and
    the float64 values it stands for."""
    x = rng.standard_normal((kvh, N_CTX, d)).astype(np.float32)
    if kv == "float32":
        return x, None, x.astype(np.float64)
    if kv == "float16":
        h = x.astype(np.float16)
        return h.view(np.uint16), None, h.astype(np.float64)
    blocks = x.reshape(kvh, N_CTX, d // 32, 32)
    dsc = (np.abs(blocks).max(axis=-1) / 127).astype(np.float16)
    inv = np.divide(1.0, dsc.astype(np.float32), out=np.zeros(dsc.shape, np.float32), where=dsc != 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    vals = q.astype(np.float64) * dsc.astype(np.float64)[..., None]
    return q.reshape(kvh, N_CTX, d), dsc.view(np.uint16), vals.reshape(kvh, N_CTX, d)


CASES = [(shape, kv) for shape in sorted(SHAPES) for kv in KV_TYPES if kv == "float32" or SHAPES[shape][2] % 32 == 0]
"""Every shape with every cache type that holds it (f16 / int8 rows are whole 32-value blocks)."""


POSITIONS = [
    (0, 0, 0),
    (0, 40, 0),
    (0, 700, 0),
    (0, 700, 100),
    (CLUSTER, 40, 0),
    (CLUSTER, 700, 100),
    (CLUSTER, 1700, 0),
]
"""(cluster, position, window): one slice, two, all 16 (two merge batches), a window; in clusters
a few positions, a window inside one cluster, and slices past one cluster's 1,536 positions."""


@pytest.mark.parametrize("shape,kv", CASES)
@pytest.mark.parametrize("cluster,pos,window", POSITIONS)
def test_attention_matches_float64(
    modules: DecodeModules,
    shape: str,
    kv: str,
    cluster: int,
    pos: int,
    window: int,
) -> None:
    """out[h] = softmax(scale q_h . K[kvh, lo..pos]) V[kvh, lo..pos] with kvh = h // G, for one
    position (one slice), two slices and all N_SPLIT = 16 slices (two batches of the merge's 8),
    with and without a window; with clusters, up to 700 positions in one cluster and 1,700 past
    one cluster's 1,536 in slices."""
    mod = module(modules, shape, kv, cluster)
    h, kvh, d = SHAPES[shape]
    g = h // kvh
    rng = np.random.default_rng(pos + 13 * window + len(kv))
    q = rng.standard_normal((h, d)).astype(np.float32)
    kc, kd, kf = cache_of(rng, kv, kvh, d)
    vc, vd, vf = cache_of(rng, kv, kvh, d)
    ids = np.array([0, pos, 0, 0], np.int32)
    pm, pl = np.zeros(h * N_SPLIT, np.float32), np.zeros(h * N_SPLIT, np.float32)
    pacc, counter = np.zeros(h * N_SPLIT * d, np.float32), np.zeros(kvh, np.int32)
    out = np.full(h * d, np.nan, np.float32)
    scale = 1 / np.sqrt(d)
    warps = decode_src.attn_warps(g, d, cluster)
    args = (q, kc, vc, kd, vd, ids, pm, pl, pacc, counter, out, N_CTX, window, np.float32(scale), 0, None, None, None)
    grid = (kvh, decode_src.attn_blocks(N_SPLIT, cluster))
    mod.launch("attn_decode", grid, 32 * warps, *args, cluster=max(1, cluster))
    lo = max(0, pos - window + 1) if window else 0
    want = np.empty((h, d))
    for i in range(h):
        s = scale * (kf[i // g, lo : pos + 1] @ q[i].astype(np.float64))
        p = np.exp(s - s.max())
        want[i] = (p / p.sum()) @ vf[i // g, lo : pos + 1]
    assert np.allclose(out.reshape(h, d), want, rtol=2e-5, atol=2e-6), (shape, kv, pos, window)
    assert counter.tolist() == [0] * kvh  # the last block of each KV head resets its counter


@pytest.mark.parametrize("cluster", [0, CLUSTER])
@pytest.mark.parametrize("aq", [1, 2])
def test_attention_rounds_the_output_projection_input(modules: DecodeModules, aq: int, cluster: int) -> None:
    """With `aq` set the merging block (with clusters: each block its share of the outputs) also
    rounds its heads' outputs into the integer GEMV's input (q8_0 / q8_k groups, as `qprep_x`
    does without a norm)."""
    mod = module(modules, "g4-d128", "float16", cluster)
    h, kvh, d = SHAPES["g4-d128"]
    rng = np.random.default_rng(aq)
    q = rng.standard_normal((h, d)).astype(np.float32)
    kc, _, _ = cache_of(rng, "float16", kvh, d)
    vc, _, _ = cache_of(rng, "float16", kvh, d)
    ids = np.array([0, 300, 0, 0], np.int32)
    pm, pl = np.zeros(h * N_SPLIT, np.float32), np.zeros(h * N_SPLIT, np.float32)
    pacc, counter = np.zeros(h * N_SPLIT * d, np.float32), np.zeros(kvh, np.int32)
    out = np.zeros(h * d, np.float32)
    xq, xd, xs16 = np.zeros(h * d, np.int8), np.zeros(h * d // 32, np.float32), np.zeros(h * d // 16, np.int32)
    warps = decode_src.attn_warps(h // kvh, d, cluster)
    args = (q, kc, vc, None, None, ids, pm, pl, pacc, counter, out, N_CTX, 0, np.float32(d**-0.5), aq, xq, xd, xs16)
    grid = (kvh, decode_src.attn_blocks(N_SPLIT, cluster))
    mod.launch("attn_decode", grid, 32 * warps, *args, cluster=max(1, cluster))
    group = 32 if aq == 1 else 256
    ref = NumpyOps.act_quant(out[None], "q8_0" if aq == 1 else "q8_k")[0]
    got = xq.astype(np.float32) * np.repeat(xd[: h * d // group], group)
    assert np.allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert np.array_equal(xs16, xq.astype(np.int32).reshape(-1, 16).sum(axis=1))
