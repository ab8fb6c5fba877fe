"""The native backend's non-matrix ops (RMSNorm, RoPE, flash attention, SwiGLU, GeGLU) equal
NumPy twins of llama.cpp's x86 CPU arithmetic bit for bit, on the SIMD and the portable build.

Each twin spells out ggml's order of float operations (`ggml-cpu/ops.cpp`, `vec.h`): where
ggml's build fuses a multiply and an add the twin uses `fma32`, where it calls libm (expf, cosf,
sinf, tanhf) the twin calls the same libm through ctypes. Skipped without a C compiler.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
import pytest

from engine.backends.cpu_native import build_library, native_available
from engine.backends.cpu_native_ops import NativeOps
from tests.test_cpu_native import PORTABLE_FLAGS, fma32

OK, WHY = native_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"native kernels unavailable: {WHY}")

F32, F16 = np.float32, np.float16

_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
for _name in ("expf", "cosf", "sinf", "tanhf"):
    getattr(_libm, _name).restype = ctypes.c_float
    getattr(_libm, _name).argtypes = [ctypes.c_float]
_libm.powf.restype = ctypes.c_float
_libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]


def libm(name: str, x: np.ndarray) -> np.ndarray:
    fn = getattr(_libm, name)
    flat = np.asarray(x, F32).ravel()
    return np.array([fn(float(v)) for v in flat], dtype=F32).reshape(np.shape(x))


# --- twins -----------------------------------------------------------------------------------
def twin_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    sq = (x * x).astype(F32).astype(np.float64)
    total = np.cumsum(sq, axis=-1)[..., -1:]  # sequential double sum, as ggml's loop
    mean = (total / x.shape[-1]).astype(F32)
    scale = (F32(1) / np.sqrt((mean + F32(eps)).astype(F32))).astype(F32)
    return ((x * scale).astype(F32) * w).astype(F32)


def twin_rope_cache(n: int, dims: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    ts = F32(_libm.powf(base, -2.0 / dims))
    theta = np.arange(n, dtype=F32)
    cos = np.empty((n, dims // 2), F32)
    sin = np.empty_like(cos)
    for i in range(dims // 2):
        cos[:, i], sin[:, i] = libm("cosf", theta), libm("sinf", theta)
        theta = (theta * ts).astype(F32)
    return cos, sin


def twin_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    x0, x1 = x[..., i0], x[..., i1]
    out[..., i0] = fma32(x0, c, -(x1 * s).astype(F32))
    out[..., i1] = fma32(x0, s, (x1 * c).astype(F32))
    return out


def _bits(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, F32).view(np.uint32).astype(np.uint64)


def _float(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, np.uint64) & 0xFFFFFFFF).astype(np.uint32).view(F32)


def twin_v_expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (AVX2): exp via 2^n * (1 + polynomial), with its overflow/underflow branches."""
    with np.errstate(all="ignore"):  # the unused lanes of the branches overflow
        return _v_expf(np.asarray(x, F32))


def _v_expf(x: np.ndarray) -> np.ndarray:

    def c(h: str) -> np.ndarray:
        return np.full(x.shape, float.fromhex(h), F32)

    r = c("0x1.8p23")
    z = fma32(x, c("0x1.715476p+0"), r)
    n = (z - r).astype(F32)
    b = fma32(-n, c("0x1.7f7d1cp-20"), fma32(-n, c("0x1.62e4p-1"), x))
    e = (_bits(z) << np.uint64(23)) & np.uint64(0xFFFFFFFF)
    k = _float(e + _bits(F32(1)))
    u = (b * b).astype(F32)
    j = fma32(
        fma32(
            fma32(c("0x1.0e4020p-7"), b, c("0x1.573e2ep-5")),
            u,
            fma32(c("0x1.555e66p-3"), b, c("0x1.fffdb6p-2")),
        ),
        u,
        (c("0x1.ffffecp-1") * b).astype(F32),
    )
    out = fma32(j, k, k)
    big = np.abs(n) > 126
    g = np.where(n <= 0, np.uint64(0x82000000), np.uint64(0))
    s1 = _float(g + np.uint64(0x7F000000))
    s2 = _float((e - g) & np.uint64(0xFFFFFFFF))
    mid = (fma32(s2, j, s2) * s1).astype(F32)
    huge = (s1 * s1).astype(F32)
    out = np.where(big, np.where(np.abs(n) > 192, huge, mid), out)
    return out.astype(F32)


def twin_swiglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    nv = g.shape[-1] & ~7
    with np.errstate(over="ignore"):
        e = np.concatenate([twin_v_expf((F32(0) - g[:, :nv]).astype(F32)), libm("expf", -g[:, nv:])], axis=1)
    return ((g / (F32(1) + e).astype(F32)).astype(F32) * u).astype(F32)


def twin_geglu(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    h = np.arange(65536, dtype=np.uint16).view(F16).astype(F32)
    h = np.where(np.abs(h) < 10, h, F32(0))  # only |x| < 10 is looked up
    inner = fma32((F32(0.044715) * h).astype(F32), h, np.ones_like(h))
    arg = ((F32(0.7978845608028654) * h).astype(F32) * inner).astype(F32)
    t = libm("tanhf", arg)
    table = ((F32(0.5) * h).astype(F32) * (F32(1) + t).astype(F32)).astype(F32).astype(F16)
    with np.errstate(over="ignore"):
        looked = table[g.astype(F16).view(np.uint16)].astype(F32)
    a = np.where(g <= -10, F32(0), np.where(g >= 10, g, looked))
    return (a * u).astype(F32)


def twin_dot_f16(k: np.ndarray, q: np.ndarray) -> F32:
    """ggml_vec_dot_f16 (AVX2): 4 x 8 fused accumulators over 32-element steps, then its reduce."""
    acc = np.zeros((4, 8), F32)
    for i in range(0, len(k) & ~31, 32):
        acc = fma32(k[i : i + 32].reshape(4, 8), q[i : i + 32].reshape(4, 8), acc)
    x0 = ((acc[0] + acc[2]).astype(F32) + (acc[1] + acc[3]).astype(F32)).astype(F32)
    t = (x0[:4] + x0[4:]).astype(F32)
    return F32((t[0] + t[1]).astype(F32) + (t[2] + t[3]).astype(F32))


def twin_attention(q, kc, vc, start, window, scale):  # type: ignore[no-untyped-def]
    """ggml's CPU flash attention over an fp16 cache: fp16 query, online softmax with libm expf,
    an fp16 accumulator of V rounded after every key, divided by the sum at the end."""
    t, h, d = q.shape
    kv, _, dv = vc.shape
    out = np.empty((t, h * dv), F32)
    for ti in range(t):
        pos = start + ti
        lo = max(0, pos - window + 1) if window else 0
        for hi in range(h):
            kh, vh = kc[hi // (h // kv)].astype(F32), vc[hi // (h // kv)].astype(F32)
            qh = q[ti, hi].astype(F16).astype(F32)
            m, s_sum = F32(-np.inf), F32(0)
            acc = np.zeros(dv, F32)
            for ic in range(lo, pos + 1):
                sc = F32(twin_dot_f16(kh[ic], qh) * F32(scale))
                ms = vs = F32(1)
                if sc > m:
                    ms = F32(_libm.expf(float(m - sc)))
                    m = sc
                    acc = (acc * ms).astype(F32).astype(F16).astype(F32)
                else:
                    vs = F32(_libm.expf(float(sc - m)))
                acc = fma32(vh[ic], np.full(dv, vs, F32), acc).astype(F16).astype(F32)
                s_sum = fma32(np.array(s_sum), np.array(ms), np.array(vs))[()]
            out[ti, hi * dv : (hi + 1) * dv] = (acc * (F32(1) / s_sum if s_sum else F32(0))).astype(F32)
    return out


# --- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ops() -> NativeOps:
    return NativeOps(threads=2)


@pytest.fixture(scope="module")
def portable() -> NativeOps:
    """NativeOps on the baseline-ISA build (portable C, fmaf from libm, no OpenMP)."""
    lib, why = build_library(PORTABLE_FLAGS)
    if lib is None:
        pytest.skip(why)
    o = NativeOps(threads=1)
    o.lib = lib
    return o


BUILDS = ["ops", "portable"]


# --- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", BUILDS)
def test_rms_norm_is_ggml_bit_for_bit(build: str, request: pytest.FixtureRequest) -> None:
    """RMSNorm sums float squares in double and scales by 1/sqrtf(mean + eps), then by the weight."""
    o = request.getfixturevalue(build)
    rng = np.random.default_rng(1)
    for shape in ((1, 576), (5, 3, 64), (37, 640)):
        x = (rng.standard_normal(shape) * rng.uniform(0.01, 30)).astype(F32)
        w = rng.standard_normal(shape[-1]).astype(F32)
        assert np.array_equal(o.rms_norm(x, w, 1e-6), twin_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("build", BUILDS)
def test_rope_tables_and_rotation_are_ggml_bit_for_bit(build: str, request: pytest.FixtureRequest) -> None:
    """RoPE tables follow ggml's float theta recurrence with libm cosf/sinf; rotation fuses one multiply-add."""
    o = request.getfixturevalue(build)
    cos, sin = o.rope_tables(300, 64, 100000.0, 1.0)
    tc, ts = twin_rope_cache(300, 64, 100000.0)
    assert np.array_equal(cos, tc) and np.array_equal(sin, ts)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 3, 80)).astype(F32)  # 64 of 80 dims rotate
    for style in ("neox", "interleaved"):
        got = o.rope(x, cos[290:297], sin[290:297], style)
        want = twin_rope(x, cos[290:297], sin[290:297], style == "neox")
        assert np.array_equal(got, want), style
        assert np.array_equal(got[..., 64:], x[..., 64:])


@pytest.mark.parametrize("build", BUILDS)
def test_swiglu_uses_ggml_v_expf_and_libm_tail(build: str, request: pytest.FixtureRequest) -> None:
    """SwiGLU rounds like ggml's AVX2 path (its exp approximation in groups of 8, libm expf for the tail)."""
    o = request.getfixturevalue(build)
    rng = np.random.default_rng(3)
    gu = (rng.standard_normal((4, 2 * 45)) * 6).astype(F32)
    gu[0, :8] = [-120.0, -90.0, -88.5, 0.0, 88.0, 95.0, 150.0, -0.0]  # overflow/underflow branches
    got = o.gated_act(gu[:, :45], gu[:, 45:], "silu")
    want = twin_swiglu(gu[:, :45], gu[:, 45:])
    assert np.array_equal(got, want)
    assert not np.array_equal(
        want, (gu[:, :45] / (1 + np.exp(-gu[:, :45].astype(np.float64))) * gu[:, 45:]).astype(F32)
    )


@pytest.mark.parametrize("build", BUILDS)
def test_geglu_uses_the_fp16_gelu_table(build: str, request: pytest.FixtureRequest) -> None:
    """GeGLU looks GELU up in ggml's fp16 table (0 below -10, identity above 10)."""
    o = request.getfixturevalue(build)
    rng = np.random.default_rng(4)
    gu = (rng.standard_normal((3, 2 * 64)) * 4).astype(F32)
    gu[0, :4] = [-12.0, -10.0, 10.0, 11.5]
    got = o.gated_act(gu[:, :64], gu[:, 64:], "gelu_tanh")
    assert np.array_equal(got, twin_geglu(gu[:, :64], gu[:, 64:]))


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize(("start", "window"), [(0, 0), (3, 0), (2, 4)])
def test_flash_attention_is_ggml_bit_for_bit(
    build: str, start: int, window: int, request: pytest.FixtureRequest
) -> None:
    """Attention over an fp16 cache equals ggml's CPU flash attention (fp16 V accumulator, online softmax)."""
    o = request.getfixturevalue(build)
    rng = np.random.default_rng(5 + start + window)
    t, h, kv, d, n_ctx = 5, 4, 2, 64, 16
    q = (rng.standard_normal((t, h, d)) * 2).astype(F32)
    kc = (rng.standard_normal((kv, n_ctx, d)) * 2).astype(F16)
    vc = rng.standard_normal((kv, n_ctx, d)).astype(F16)
    got = o.attention(q, kc, vc, start, window, 0.125)
    assert np.array_equal(got, twin_attention(q, kc, vc, start, window, 0.125))


def test_attention_rows_do_not_depend_on_batching(ops: NativeOps) -> None:
    """A query row's attention output is the same computed alone or with other rows."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((9, 6, 64)).astype(F32)
    kc = rng.standard_normal((3, 32, 64)).astype(F16)
    vc = rng.standard_normal((3, 32, 64)).astype(F16)
    whole = ops.attention(q, kc, vc, 4, 0, 0.125)
    for i in range(9):
        assert np.array_equal(ops.attention(q[i : i + 1], kc, vc, 4 + i, 0, 0.125), whole[i : i + 1])
