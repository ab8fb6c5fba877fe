"""The native CPU kernels (`engine/kernels/cpu/qgemv.c`) against a NumPy twin of their arithmetic.

The twin below re-implements, in NumPy, what the C code computes: llama.cpp's activation
quantization (Q8_0 / Q8_1 as its x86 AVX2 build rounds them, Q8_K as its reference), exact
integer block dot products, and the float accumulation of ggml's AVX2 `ggml_vec_dot_*` for the
32-blocks (eight fused multiply-add lanes, then its horizontal sum) and of its generic order for
the K-quants. Outputs must be bit-identical (not merely close). Skipped when no C compiler can
build the kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cpu_native import ACT_KIND, GGML_TYPE, build_library, native_available
from engine.backends.cpu_native_ops import NativeOps, QParts, QWeight
from engine.quants import BLOCK_BYTES, dequantize, k_scales_mins

OK, WHY = native_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"native kernels unavailable: {WHY}")

F32 = np.float32


# --- NumPy twin ----------------------------------------------------------------------------
def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add: the product of two float32 values is exact in long double."""
    ld = np.longdouble
    return (np.asarray(a, F32).astype(ld) * np.asarray(b, F32).astype(ld) + np.asarray(c, F32).astype(ld)).astype(F32)


def hsum8(acc: np.ndarray) -> np.ndarray:
    """ggml's hsum_float_8 over the last axis: ((0+4) + (2+6)) + ((1+5) + (3+7)), float32."""
    r = (acc[..., 0:4] + acc[..., 4:8]).astype(F32)
    return ((r[..., 0] + r[..., 2]).astype(F32) + (r[..., 1] + r[..., 3]).astype(F32)).astype(F32)


def quant_32(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's AVX2 quantize_row_q8_1 (its q and d are q8_0's): q [T, nb, 32], d16 [T, nb], s16."""
    xb = x.reshape(x.shape[0], -1, 32).astype(F32)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / F32(127)).astype(F32)
    inv = np.where(amax != 0, F32(127) / np.where(amax != 0, amax, F32(1)), F32(0)).astype(F32)
    q = np.rint((xb * inv[..., None]).astype(F32)).astype(np.int64)  # ties to even
    s = _f16((q.sum(-1).astype(F32) * d).astype(F32))
    return q, _f16(d), s


def quant_256(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml quantize_row_q8_K_ref: q [T, nb, 256], d [T, nb] (fp32), bsums [T, nb, 16]."""
    xb = x.reshape(x.shape[0], -1, 256).astype(F32)
    idx = np.abs(xb).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(xb, idx, axis=-1)[..., 0]
    zero = mx == 0
    iscale = (F32(-127) / np.where(zero, F32(1), mx)).astype(F32)
    q = np.minimum(np.rint((xb * iscale[..., None]).astype(F32)), 127).astype(np.int64)
    q[zero] = 0
    d = np.where(zero, F32(0), (F32(1) / iscale).astype(F32)).astype(F32)
    return q, d, q.reshape(q.shape[0], q.shape[1], 16, 16).sum(-1)


def _nib(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64)


def _hbits(qh: np.ndarray) -> np.ndarray:
    return np.unpackbits(qh, axis=-1, bitorder="little").astype(np.int64) << 4


def _fp16_col(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(F32)[..., 0]


def twin_legacy(type_name: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, BLOCK_BYTES[type_name][1])
    q, yd, ys = quant_32(x)  # [T, nb, 32]
    wd = _fp16_col(b[..., 0:2])  # [R, nb]
    wm = None
    if type_name == "Q4_0":
        w = _nib(b[..., 2:18]) - 8
    elif type_name == "Q4_1":
        w, wm = _nib(b[..., 4:20]), _fp16_col(b[..., 2:4])
    elif type_name == "Q5_0":
        w = (_nib(b[..., 6:22]) | _hbits(b[..., 2:6])) - 16
    elif type_name == "Q5_1":
        w, wm = _nib(b[..., 8:24]) | _hbits(b[..., 4:8]), _fp16_col(b[..., 2:4])
    else:  # Q8_0
        w = b[..., 2:34].view(np.int8).astype(np.int64)
    nb = w.shape[1]
    out = np.empty((x.shape[0], rows), dtype=F32)
    for t in range(x.shape[0]):
        # lane m of a block: the exact integer sum of the products of elements 4m..4m+3
        lanes = np.einsum("rblk,blk->rbl", w.reshape(rows, nb, 8, 4), q[t].reshape(nb, 8, 4))
        acc = np.zeros((rows, 8), dtype=F32)
        summs = np.zeros(rows, dtype=F32)
        for ib in range(nb):
            dd = (wd[:, ib] * yd[t, ib]).astype(F32)
            acc = fma32(dd[:, None], lanes[:, ib].astype(F32), acc)
            if wm is not None:
                summs = (summs + (wm[:, ib] * ys[t, ib]).astype(F32)).astype(F32)
        out[t] = (hsum8(acc) + summs).astype(F32) if wm is not None else hsum8(acc)
    return out


def _k_values(type_name: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Integer values [R, nb, 256], per-group scales [R, nb, G], mins [R, nb, 8] or None."""
    r, nb = b.shape[:2]
    flat = b.reshape(r * nb, -1)
    if type_name == "Q6_K":
        ql = flat[:, 0:128].reshape(-1, 2, 64)
        qh = flat[:, 128:192].reshape(-1, 2, 32)
        lo = np.stack([ql[:, :, :32] & 15, ql[:, :, 32:] & 15, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
        v = (lo | (hi << 4)).astype(np.int64) - 32
        sc = flat[:, 192:208].view(np.int8).astype(np.int64)
        return v.reshape(r, nb, 256), sc.reshape(r, nb, 16), None
    sc, mn = k_scales_mins(flat[:, 4:16])
    qs = flat[:, 16:144] if type_name == "Q4_K" else flat[:, 48:176]
    c = qs.reshape(-1, 4, 32)
    v = np.stack([c & 15, c >> 4], axis=2).reshape(-1, 8, 32).astype(np.int64)
    if type_name == "Q5_K":
        qh = flat[:, 16:48]
        hb = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
        v = v | (hb.astype(np.int64) << 4)
    return (
        v.reshape(r, nb, 256),
        sc.astype(np.int64).reshape(r, nb, 8),
        mn.astype(np.int64).reshape(r, nb, 8),
    )


def twin_k(type_name: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The K-quants. Q5_K: ggml's generic order (lane l: elements i % 8 == l, mul then add).
    Q4_K / Q6_K: for matrices of rows % 8 == 0 the order of llama.cpp's repacked kernels (one
    fma per super-block; Q4_K rows of a batch in groups of four: one per pair of sub-blocks),
    else its AVX2 vec_dot (lane m: elements 4m..4m+3 of each 32, fma, then hsum)."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, BLOCK_BYTES[type_name][1])
    v, sc, mn = _k_values(type_name, b)
    nb = v.shape[1]
    group = 256 // sc.shape[-1]
    if type_name == "Q6_K":
        wd, wmin = _fp16_col(b[..., 208:210]), None
    else:
        wd, wmin = _fp16_col(b[..., 0:2]), _fp16_col(b[..., 2:4])
    q, yd, bsums = quant_256(x)
    t_all = x.shape[0]
    gemm_rows = t_all - t_all % 4 if t_all > 3 else 0
    out = np.empty((t_all, rows), dtype=F32)
    for t in range(t_all):
        scaled = v * q[t][None] * np.repeat(sc, group, axis=-1)  # [R, nb, 256] exact ints
        bs32 = bsums[t].reshape(nb, 8, 2).sum(-1)  # [nb, 8] sums of each 32 activations
        imin = None if mn is None else (mn * bs32[None]).reshape(rows, nb, 4, 2).sum(-1)  # [R, nb, 4]
        if type_name == "Q5_K":
            aux32 = scaled.reshape(rows, nb, 32, 8).sum(axis=2)  # lane l: elements i % 8 == l
            sums = np.zeros((rows, 8), dtype=F32)
            sumf = np.zeros(rows, dtype=F32)
            for ib in range(nb):
                dd = (wd[:, ib] * yd[t, ib]).astype(F32)
                sums = (sums + (dd[:, None] * aux32[:, ib].astype(F32)).astype(F32)).astype(F32)
                dmin = (wmin[:, ib] * yd[t, ib]).astype(F32)
                sumf = (sumf - (dmin * imin[:, ib].sum(-1).astype(F32)).astype(F32)).astype(F32)
            for lane in range(8):
                sumf = (sumf + sums[:, lane]).astype(F32)
            out[t] = sumf
        elif rows % 8 == 0:  # repacked by llama.cpp
            groups = 4 if (type_name == "Q4_K" and t < gemm_rows) else 1
            part = scaled.reshape(rows, nb, groups, -1).sum(-1)
            acc = np.zeros(rows, dtype=F32)
            accmin = np.zeros(rows, dtype=F32)
            for ib in range(nb):
                dd = (wd[:, ib] * yd[t, ib]).astype(F32)
                for g in range(groups):
                    acc = fma32(part[:, ib, g].astype(F32), dd, acc)
                if imin is not None:
                    dm = (wmin[:, ib] * yd[t, ib]).astype(F32)
                    mins = imin[:, ib] if groups == 4 else imin[:, ib].sum(-1, keepdims=True)
                    for g in range(mins.shape[-1]):
                        accmin = fma32(mins[:, g].astype(F32), dm, accmin)
            out[t] = (acc - accmin).astype(F32)
        else:  # AVX2 vec_dot
            lanes = scaled.reshape(rows, nb, 8, 8, 4).sum(axis=(2, 4))  # lane m: 4m..4m+3 of each 32
            acc = np.zeros((rows, 8), dtype=F32)
            accm = np.zeros((rows, 4), dtype=F32)
            for ib in range(nb):
                dd = (yd[t, ib] * wd[:, ib]).astype(F32)
                if imin is not None:
                    dmin = (-yd[t, ib] * wmin[:, ib]).astype(F32)
                    accm = fma32(dmin[:, None], imin[:, ib].astype(F32), accm)
                acc = fma32(dd[:, None], lanes[:, ib].astype(F32), acc)
            tot = hsum8(acc)
            if imin is not None:
                m4 = ((accm[:, 0] + accm[:, 2]).astype(F32) + (accm[:, 1] + accm[:, 3]).astype(F32)).astype(F32)
                tot = (tot + m4).astype(F32)
            out[t] = tot
    return out


def twin(type_name: str, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    return twin_k(type_name, raw, x) if type_name.endswith("_K") else twin_legacy(type_name, raw, x)


# --- random weights ------------------------------------------------------------------------
def random_blocks(type_name: str, rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes with sane fp16 scales (random bytes elsewhere)."""
    block, nbytes = BLOCK_BYTES[type_name]
    raw = rng.integers(0, 256, (rows, n // block, nbytes), dtype=np.uint8)

    def put(off: int, scale: float) -> None:
        v = (rng.standard_normal((rows, n // block)) * scale).astype(np.float16)
        raw[..., off : off + 2] = v.view(np.uint8).reshape(rows, n // block, 2)

    if type_name == "Q6_K":
        put(208, 0.01)
    else:
        put(0, 0.02)
        if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            put(2, 0.02)
    return raw.reshape(rows, -1)


def native_gemm(lib, type_name: str, raw: np.ndarray, x: np.ndarray, threads: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    t, n = x.shape
    kind = ACT_KIND[type_name]
    x = np.ascontiguousarray(x, dtype=F32)
    buf = np.empty((t, lib.qg_act_row_bytes(kind, n)), dtype=np.uint8)
    lib.qg_quantize(kind, x.ctypes.data, n, t, n, buf.ctypes.data, threads)
    raw = np.ascontiguousarray(raw)
    y = np.full((t, raw.shape[0]), np.nan, dtype=F32)
    rc = lib.qg_gemm(
        GGML_TYPE[type_name],
        raw.ctypes.data,
        raw.shape[0],
        n,
        buf.ctypes.data,
        t,
        y.ctypes.data,
        raw.shape[0],
        None,
        threads,
    )
    assert rc == 0
    return y


TYPES = sorted(GGML_TYPE)
PORTABLE_FLAGS = ["-O2", "-std=gnu99", "-ffp-contract=off", "-shared", "-fPIC"]
"""The kernels for the baseline ISA: portable C loops, fmaf from libm, no SIMD paths, no OpenMP."""


@pytest.fixture(scope="module")
def lib():  # type: ignore[no-untyped-def]
    from engine.backends.cpu_native import load_library

    return load_library()[0]


@pytest.fixture(scope="module")
def portable_lib():  # type: ignore[no-untyped-def]
    """The same source built for the baseline ISA (portable C loops, no SIMD paths, no OpenMP)."""
    lib, why = build_library(PORTABLE_FLAGS)
    if lib is None:
        pytest.skip(why)
    return lib


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_bit_exact_with_twin(lib, type_name: str, threads: int) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(GGML_TYPE[type_name] * 10 + threads)
    block = BLOCK_BYTES[type_name][0]
    for rows, nblk, t in ((1, 1, 1), (7, 3, 1), (65, 5, 2), (130, 2, 3), (33, 4, 5), (9, 2, 9), (16, 2, 6), (8, 1, 4)):
        n = nblk * block
        raw = random_blocks(type_name, rows, n, rng)
        x = (rng.standard_normal((t, n)) * rng.uniform(0.1, 10)).astype(F32)
        x[0, : min(n, 40)] = 0  # an all-zero block (d = 0)
        got = native_gemm(lib, type_name, raw, x, threads)
        want = twin(type_name, raw, x)
        assert np.array_equal(got, want), (type_name, rows, n, t, np.abs(got - want).max())
        # and close to the float product of the dequantized weights
        ref = x @ dequantize(raw, type_name, (rows, n)).T
        scale = np.abs(ref).max() + 1e-6
        assert np.abs(got - ref).max() / scale < 0.05


@pytest.mark.parametrize("type_name", TYPES)
def test_simd_and_portable_paths_agree(lib, portable_lib, type_name: str) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(7)
    n = 2 * BLOCK_BYTES[type_name][0]
    for rows in (33, 16):  # 16: the orders of llama.cpp's repacked Q4_K / Q6_K
        raw = random_blocks(type_name, rows, n, rng)
        x = rng.standard_normal((6, n)).astype(F32)  # 4 + 2 rows: the K-row dot and its remainder
        assert np.array_equal(native_gemm(lib, type_name, raw, x, 2), native_gemm(portable_lib, type_name, raw, x, 1))


def test_fp16_rounding_matches_numpy(lib) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    vals = np.concatenate(
        [
            rng.standard_normal(20000) * 10.0 ** rng.integers(-9, 6, 20000).astype(float),
            halves[np.isfinite(halves)][::7].astype(np.float64),
            [0.0, -0.0, 65504.0, 65519.0, 65520.0, 1e9, 2.0**-24, 2.0**-25, 3 * 2.0**-26],
        ]
    ).astype(F32)
    got = np.array([lib.qg_f32_to_f16(float(v)) for v in vals], dtype=np.uint16)
    with np.errstate(over="ignore"):
        want = vals.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)


def test_ops_keep_blocks_and_fuse(lib) -> None:  # type: ignore[no-untyped-def]
    ops = NativeOps(threads=2)
    rng = np.random.default_rng(5)
    a = QWeight(random_blocks("Q5_0", 48, 64, rng), "Q5_0", (48, 64))
    b = QWeight(random_blocks("Q5_0", 16, 64, rng), "Q5_0", (16, 64))
    c = QWeight(random_blocks("Q8_0", 16, 64, rng), "Q8_0", (16, 64))
    same = ops.concat_rows([a, b])
    assert isinstance(same, QWeight) and same.shape == (64, 64) and same.nbytes == a.nbytes + b.nbytes
    mixed = ops.concat_rows([a, b, c])
    assert isinstance(mixed, QParts) and mixed.shape == (80, 64)
    x = rng.standard_normal((3, 64)).astype(F32)
    bias = rng.standard_normal(80).astype(F32)
    y = ops.linear(x, mixed, bias)
    want = np.concatenate([twin("Q5_0", a.raw, x), twin("Q5_0", b.raw, x), twin("Q8_0", c.raw, x)], axis=1)
    assert np.array_equal(y, want + bias)
    rows = ops.embed_rows(c, np.array([3, 0, 3]), 64)
    assert np.array_equal(rows, dequantize(c.raw, "Q8_0", (16, 64))[[3, 0, 3]])


# The real models against llama.cpp: tests/test_engine_oracle.py runs both backends.


def test_fallback_build_says_why_the_better_one_failed(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """When a flag set fails to build, the next one is used and the reason names the failure (and is logged)."""
    from engine.backends import cpu_native

    good = cpu_native._flag_sets()[-1]
    monkeypatch.setattr(cpu_native, "_flag_sets", lambda extra=(): [good + ["-fno-such-flag-genie"], good])
    with caplog.at_level("WARNING", logger="engine.backends.cpu_native"):
        lib, why = cpu_native._build()
    assert lib is not None
    assert "after:" in why and "-fno-such-flag-genie" in why
    assert any("fell back" in r.getMessage() for r in caplog.records)
