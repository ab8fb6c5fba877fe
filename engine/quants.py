"""Dequantization of GGUF block formats in NumPy: the reference every other kernel is tested against.

Each function takes the stored bytes as ``uint8[rows, bytes_per_row]`` and returns
``float32[rows, cols]``. Layouts follow ggml's block structs (``ggml-common.h``); the tests check
every type against the `gguf` package's own Python implementation.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

QK = 32  # elements per block of the legacy formats
QK_K = 256  # elements per super-block of the K formats

BLOCK_BYTES = {
    "Q4_0": (QK, 18),
    "Q4_1": (QK, 20),
    "Q5_0": (QK, 22),
    "Q5_1": (QK, 24),
    "Q8_0": (QK, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}


def _blocks(raw: np.ndarray, type_name: str) -> tuple[np.ndarray, int]:
    block, nbytes = BLOCK_BYTES[type_name]
    rows = raw.shape[0] if raw.ndim > 1 else 1
    return np.ascontiguousarray(raw).reshape(-1, nbytes), rows


def _f16(b: np.ndarray) -> np.ndarray:
    """Two little-endian bytes per row -> float32 column."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: the 16 low nibbles, then the 16 high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a uint32 bit field -> [n, 32] values 0 or 16 (bit j -> element j)."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")
    return bits.astype(np.uint8) << 4


def dq_q4_0(raw: np.ndarray) -> np.ndarray:
    b, rows = _blocks(raw, "Q4_0")
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).astype(np.int8) - 8
    return (q * d).reshape(rows, -1)


def dq_q4_1(raw: np.ndarray) -> np.ndarray:
    b, rows = _blocks(raw, "Q4_1")
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20])
    return (q * d + m).reshape(rows, -1)


def dq_q5_0(raw: np.ndarray) -> np.ndarray:
    b, rows = _blocks(raw, "Q5_0")
    d = _f16(b[:, 0:2])
    q = (_nibbles(b[:, 6:22]) | _high_bits(b[:, 2:6])).astype(np.int8) - 16
    return (q * d).reshape(rows, -1)


def dq_q5_1(raw: np.ndarray) -> np.ndarray:
    b, rows = _blocks(raw, "Q5_1")
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:24]) | _high_bits(b[:, 4:8])
    return (q * d + m).reshape(rows, -1)


def dq_q8_0(raw: np.ndarray) -> np.ndarray:
    b, rows = _blocks(raw, "Q8_0")
    d = _f16(b[:, 0:2])
    q = b[:, 2:34].view(np.int8)
    return (q * d).reshape(rows, -1)


def k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins per super-block."""
    s = s.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty((s.shape[0], 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 8, 32]: per 32-byte chunk, low nibbles (sub-block 2j) then high (2j+1)."""
    c = qs.reshape(-1, 4, 32)
    return np.stack([c & 0x0F, c >> 4], axis=2).reshape(-1, 8, 32)


def dq_q4_k(raw: np.ndarray) -> np.ndarray:
    b, rows = _blocks(raw, "Q4_K")
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_scales_mins(b[:, 4:16])
    q = _k_nibbles(b[:, 16:144])
    y = (d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]
    return y.reshape(rows, -1).astype(np.float32)


def dq_q5_k(raw: np.ndarray) -> np.ndarray:
    b, rows = _blocks(raw, "Q5_K")
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_scales_mins(b[:, 4:16])
    qh = b[:, 16:48]  # bit i of qh[l] is the 5th bit of element l of sub-block i
    hb = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = _k_nibbles(b[:, 48:176]) | (hb << 4)
    y = (d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]
    return y.reshape(rows, -1).astype(np.float32)


def dq_q6_k(raw: np.ndarray) -> np.ndarray:
    b, rows = _blocks(raw, "Q6_K")
    ql = b[:, 0:128].reshape(-1, 2, 64)  # two halves of 128 elements
    qh = b[:, 128:192].reshape(-1, 2, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # 16 scales, one per 16 elements
    d = _f16(b[:, 208:210])
    lo = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], 2)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = (lo | (hi << 4)).astype(np.int8) - 32  # [n, half, quarter, 32]
    y = q.reshape(-1, 16, 16) * (d * sc)[:, :, None]
    return y.reshape(rows, -1).astype(np.float32)


DEQUANTIZE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": dq_q4_0,
    "Q4_1": dq_q4_1,
    "Q5_0": dq_q5_0,
    "Q5_1": dq_q5_1,
    "Q8_0": dq_q8_0,
    "Q4_K": dq_q4_k,
    "Q5_K": dq_q5_k,
    "Q6_K": dq_q6_k,
}


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Stored tensor bytes of `type_name` -> float32 array of the logical `shape`."""
    if type_name == "F32":
        return np.asarray(raw, dtype=np.float32).reshape(shape)
    if type_name == "F16":
        return np.asarray(raw).view(np.float16).astype(np.float32).reshape(shape)
    if type_name == "BF16":
        u = np.asarray(raw).view(np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape)
    fn = DEQUANTIZE.get(type_name)
    if fn is None:
        raise KeyError(type_name)
    raw2 = np.asarray(raw).reshape(-1, raw.shape[-1]) if raw.ndim > 1 else np.asarray(raw)[None, :]
    out = np.empty((raw2.shape[0], int(np.prod(shape)) // raw2.shape[0]), dtype=np.float32)
    step = 4096  # in cache-sized row chunks: ~10x faster than one pass over a 262k-row table
    for i in range(0, raw2.shape[0], step):
        out[i : i + step] = fn(raw2[i : i + step])
    return out.reshape(shape)


def dequantize_rows(raw: np.ndarray, type_name: str, rows: np.ndarray, cols: int) -> np.ndarray:
    """Only the given rows of a 2-D tensor (embedding lookup without a full copy)."""
    if type_name in ("F32", "F16", "BF16"):
        return dequantize(np.asarray(raw)[rows], type_name, (len(rows), cols))
    return DEQUANTIZE[type_name](np.asarray(raw)[rows]).reshape(len(rows), cols)
