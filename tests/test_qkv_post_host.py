"""The decode step's `qkv_post` kernel (Q/K RMSNorm per head, RoPE at the device position, Q out,
K and V written into the cache at that position) on the host (tests/cuda_host.py) equals the NumPy
backend's `rms_norm` + `rope`: neox and interleaved pairs, partial rotation, with and without the
per-head norms, f32 / f16 / int8 caches. Skipped without a C++20 compiler (failed under CI=true)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.numpy_backend import NumpyOps
from tests.cuda_host import DecodeModules

pytestmark = pytest.mark.timeout(600)

N_CTX = 64
POS = 37
CASES = {
    "qwen3": (8, 2, 128, 64, True, True),  # Q/K norms, neox, the whole head rotated
    "llama": (9, 3, 64, 32, False, False),  # interleaved pairs, no Q/K norms
    "partial": (4, 2, 64, 16, True, True),  # a quarter of the dims rotated
}
"""name -> (query heads, KV heads, head size, rotated pairs, neox, Q/K norms)."""


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> DecodeModules:
    """The decode modules of these tests, built on first use."""
    return DecodeModules(tmp_path_factory)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kv", ["float32", "float16", "int8"])
def test_qkv_post_matches_numpy(modules: DecodeModules, case: str, kv: str) -> None:
    """Q = rope(norm(q)), the cache's row POS of K = rope(norm(k)) and of V = v (rounded as the
    cache stores: f16, or int8 with one f16 scale a 32 values), every other row untouched."""
    h, kvh, d, half, neox, norms = CASES[case]
    mod = modules.get(n_heads=h, n_kv_heads=kvh, head_dim=d, kv=kv, n_split=4, rope_half=half, neox=neox)
    rng = np.random.default_rng(len(case) + len(kv))
    qkv = rng.standard_normal(h * d + 2 * kvh * d).astype(np.float32)
    qn = (rng.random(d) + 0.5).astype(np.float32) if norms else None
    kn = (rng.random(d) + 0.5).astype(np.float32) if norms else None
    cos, sin = NumpyOps.rope_tables(N_CTX, 2 * half, 10000.0, 1.0)
    dt = {"float32": np.float32, "float16": np.uint16, "int8": np.int8}[kv]
    kc, vc = np.zeros((kvh, N_CTX, d), dt), np.zeros((kvh, N_CTX, d), dt)
    kd = np.zeros((kvh, N_CTX, d // 32), np.uint16) if kv == "int8" else None
    vd = np.zeros((kvh, N_CTX, d // 32), np.uint16) if kv == "int8" else None
    q_out = np.full(h * d, np.nan, np.float32)
    ids = np.array([0, POS, 0, 0], np.int32)
    args = (qkv, q_out, kc, vc, kd, vd, ids, cos, sin, qn, kn, N_CTX, np.float32(1e-6))
    mod.launch("qkv_post", h + 2 * kvh, 128, *args)

    style = "neox" if neox else "norm"
    q, k, v = (
        qkv[: h * d].reshape(h, d),
        qkv[h * d : (h + kvh) * d].reshape(kvh, d),
        qkv[(h + kvh) * d :].reshape(kvh, d),
    )
    if norms:
        q, k = NumpyOps.rms_norm(q, qn, 1e-6), NumpyOps.rms_norm(k, kn, 1e-6)
    q_ref = NumpyOps.rope(q[None], cos[POS : POS + 1], sin[POS : POS + 1], style)[0]
    k_ref = NumpyOps.rope(k[None], cos[POS : POS + 1], sin[POS : POS + 1], style)[0]
    assert np.allclose(q_out.reshape(h, d), q_ref, rtol=1e-5, atol=1e-6)

    def stored(c: np.ndarray, dsc: np.ndarray | None) -> np.ndarray:
        row = c[:, POS].astype(np.float64) if kv != "float16" else c[:, POS].view(np.float16).astype(np.float64)
        if dsc is not None:
            row = (row.reshape(kvh, d // 32, 32) * dsc[:, POS].view(np.float16).astype(np.float64)[..., None]).reshape(
                kvh, d
            )
        return row

    step = {"float32": 1e-6, "float16": 1e-3, "int8": 0.0}[kv]
    for c, dsc, ref in ((kc, kd, k_ref), (vc, vd, v)):
        got = stored(c, dsc)
        tol = np.abs(ref).reshape(kvh, -1, 32).max(axis=-1, keepdims=True) / 127 * 0.51 if kv == "int8" else None
        bound = (
            np.repeat(tol, 32, axis=-1).reshape(kvh, d) + 1e-3 * np.abs(ref)
            if tol is not None
            else step * (np.abs(ref) + 1)
        )
        assert np.all(np.abs(got - ref) <= bound), (case, kv)
        others = np.delete(c, POS, axis=1)
        assert not others.any()  # only row POS was written
