"""Reference encoders (float32 -> GGUF block bytes) for every type the engine computes with.

Simple, valid encodings (round to nearest with a max-based scale), not llama.cpp's optimised
search: they exist so tests and benchmarks can build models, and each is checked by a round trip
through `engine.quants.dequantize`. `random_blocks` makes valid random bytes fast (benchmarks).

Each encoder takes ``float32[rows, cols]`` and returns ``uint8[rows, bytes_per_row]``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .quants import BLOCK_BYTES, QK, QK_K

FLOAT_TYPES = ("F32", "F16", "BF16")


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float column [n] -> [n, 2] little-endian float16 bytes."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _inv(d: np.ndarray) -> np.ndarray:
    return np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)


def _signed_absmax(xb: np.ndarray) -> np.ndarray:
    """The value of largest magnitude in each block (sign kept), [n, k] -> [n, 1]."""
    idx = np.abs(xb).argmax(axis=-1)[:, None]
    return np.take_along_axis(xb, idx, axis=-1)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 32] values 0..15 -> [n, 16] bytes: element j low nibble, element j+16 high nibble."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _pack_high_bits(q: np.ndarray) -> np.ndarray:
    """[n, 32] 5-bit values -> [n, 4] bytes holding bit 4 of element j at bit j."""
    return np.packbits(((q >> 4) & 1).astype(np.uint8), axis=1, bitorder="little")


def _finish(blocks: np.ndarray, rows: int) -> np.ndarray:
    return np.ascontiguousarray(blocks).reshape(rows, -1)


def _split(x: np.ndarray, qk: int) -> tuple[np.ndarray, int]:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.shape[-1] % qk:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of {qk}")
    return x.reshape(-1, qk), x.shape[0]


def enc_q8_0(x: np.ndarray) -> np.ndarray:
    xb, rows = _split(x, QK)
    d = _f16_round(np.abs(xb).max(axis=1, keepdims=True) / 127)
    q = np.clip(np.round(xb * _inv(d)), -127, 127).astype(np.int8)
    return _finish(np.concatenate([_f16_bytes(d[:, 0]), q.view(np.uint8)], axis=1), rows)


def enc_q4_0(x: np.ndarray) -> np.ndarray:
    xb, rows = _split(x, QK)
    d = _f16_round(_signed_absmax(xb) / -8)
    q = np.clip(np.round(xb * _inv(d)) + 8, 0, 15)
    return _finish(np.concatenate([_f16_bytes(d[:, 0]), _pack_nibbles(q)], axis=1), rows)


def enc_q4_1(x: np.ndarray) -> np.ndarray:
    xb, rows = _split(x, QK)
    lo, hi = xb.min(axis=1, keepdims=True), xb.max(axis=1, keepdims=True)
    d, m = _f16_round((hi - lo) / 15), _f16_round(lo)
    q = np.clip(np.round((xb - m) * _inv(d)), 0, 15)
    parts = [_f16_bytes(d[:, 0]), _f16_bytes(m[:, 0]), _pack_nibbles(q)]
    return _finish(np.concatenate(parts, axis=1), rows)


def enc_q5_0(x: np.ndarray) -> np.ndarray:
    xb, rows = _split(x, QK)
    d = _f16_round(_signed_absmax(xb) / -16)
    q = np.clip(np.round(xb * _inv(d)) + 16, 0, 31).astype(np.uint8)
    parts = [_f16_bytes(d[:, 0]), _pack_high_bits(q), _pack_nibbles(q & 0x0F)]
    return _finish(np.concatenate(parts, axis=1), rows)


def enc_q5_1(x: np.ndarray) -> np.ndarray:
    xb, rows = _split(x, QK)
    lo, hi = xb.min(axis=1, keepdims=True), xb.max(axis=1, keepdims=True)
    d, m = _f16_round((hi - lo) / 31), _f16_round(lo)
    q = np.clip(np.round((xb - m) * _inv(d)), 0, 31).astype(np.uint8)
    parts = [_f16_bytes(d[:, 0]), _f16_bytes(m[:, 0]), _pack_high_bits(q), _pack_nibbles(q & 0x0F)]
    return _finish(np.concatenate(parts, axis=1), rows)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block -> the 12 packed bytes (inverse of k_scales_mins)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    s = np.empty((sc.shape[0], 12), dtype=np.uint8)
    s[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return s


def _k_affine(xb: np.ndarray, qmax: int) -> tuple[np.ndarray, ...]:
    """Super-blocks [n, 256] -> d, dmin [n], scales, mins [n, 8] (6-bit) and q [n, 8, 32]."""
    sub = xb.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)  # value = d*sc*q - dmin*mn, so the offset is <= 0
    span = (sub.max(axis=2) - lo) / qmax
    d = _f16_round(span.max(axis=1) / 63)
    dmin = _f16_round((-lo).max(axis=1) / 63)
    sc = np.clip(np.round(span * _inv(d)[:, None]), 0, 63)
    mn = np.clip(np.round(-lo * _inv(dmin)[:, None]), 0, 63)
    step = (d[:, None] * sc)[:, :, None]
    off = (dmin[:, None] * mn)[:, :, None]
    q = np.clip(np.round((sub + off) * _inv(step)), 0, qmax).astype(np.uint8)
    return d, dmin, sc, mn, q


def _k_pack_nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit -> [n, 128]: chunk c holds sub-block 2c (low) and 2c+1 (high)."""
    q = q & 0x0F
    return (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)


def enc_q4_k(x: np.ndarray) -> np.ndarray:
    xb, rows = _split(x, QK_K)
    d, dmin, sc, mn, q = _k_affine(xb, 15)
    parts = [_f16_bytes(d), _f16_bytes(dmin), pack_k_scales(sc, mn), _k_pack_nibbles(q)]
    return _finish(np.concatenate(parts, axis=1), rows)


def enc_q5_k(x: np.ndarray) -> np.ndarray:
    xb, rows = _split(x, QK_K)
    d, dmin, sc, mn, q = _k_affine(xb, 31)
    hb = ((q >> 4) & 1).astype(np.uint8)  # [n, 8 sub-blocks, 32]
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for i in range(8):
        qh |= hb[:, i, :] << i
    parts = [_f16_bytes(d), _f16_bytes(dmin), pack_k_scales(sc, mn), qh, _k_pack_nibbles(q)]
    return _finish(np.concatenate(parts, axis=1), rows)


def enc_q6_k(x: np.ndarray) -> np.ndarray:
    xb, rows = _split(x, QK_K)
    sub = xb.reshape(-1, 16, 16)
    s = _signed_absmax(sub.reshape(-1, 16)).reshape(-1, 16) / -32  # per 16 values
    d = _f16_round(np.abs(s).max(axis=1) / 127)
    sc = np.clip(np.round(s * _inv(d)[:, None]), -127, 127)
    step = (d[:, None] * sc)[:, :, None]
    q = np.clip(np.round(sub * _inv(step)) + 32, 0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)
    lo, hi = q & 0x0F, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)]
    return _finish(np.concatenate(parts, axis=1), rows)


ENCODE: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_0": enc_q4_0,
    "Q4_1": enc_q4_1,
    "Q5_0": enc_q5_0,
    "Q5_1": enc_q5_1,
    "Q8_0": enc_q8_0,
    "Q4_K": enc_q4_k,
    "Q5_K": enc_q5_k,
    "Q6_K": enc_q6_k,
}


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [rows, cols] -> stored bytes uint8 [rows, bytes_per_row] of `type_name`."""
    x = np.asarray(x, dtype=np.float32)
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x[None, :]
    if type_name == "F32":
        return np.ascontiguousarray(x2).view(np.uint8)
    if type_name == "F16":
        return np.ascontiguousarray(x2.astype(np.float16)).view(np.uint8)
    if type_name == "BF16":
        u: np.ndarray = np.ascontiguousarray(x2).view(np.uint32)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
        return np.ascontiguousarray(u.astype(np.uint16)).view(np.uint8)
    fn = ENCODE.get(type_name)
    if fn is None:
        raise KeyError(f"no encoder for tensor type {type_name}")
    out = np.empty((x2.shape[0], row_bytes(type_name, x2.shape[1])), dtype=np.uint8)
    step = 2048
    for i in range(0, x2.shape[0], step):
        out[i : i + step] = fn(x2[i : i + step])
    return out


def row_bytes(type_name: str, cols: int) -> int:
    """Bytes one row of `cols` values takes in `type_name`."""
    if type_name in FLOAT_TYPES:
        return cols * (4 if type_name == "F32" else 2)
    qk, nbytes = BLOCK_BYTES[type_name]
    return cols // qk * nbytes


# Where each type keeps its float16 scale fields, and the scale that gives unit-ish values.
_RANDOM_SCALES: dict[str, tuple[tuple[int, float], ...]] = {
    "Q4_0": ((0, 1 / 4.6),),
    "Q4_1": ((0, 1 / 4.6), (2, -7.5 / 4.6)),
    "Q5_0": ((0, 1 / 9.2),),
    "Q5_1": ((0, 1 / 9.2), (2, -15.5 / 9.2)),
    "Q8_0": ((0, 1 / 74.0),),
    "Q4_K": ((0, 1 / (4.6 * 32)), (2, 7.5 / (4.6 * 32))),
    "Q5_K": ((0, 1 / (9.2 * 32)), (2, 15.5 / (9.2 * 32))),
    "Q6_K": ((208, 1 / (18.5 * 64)),),
}


def random_blocks(rng: np.random.Generator, type_name: str, rows: int, cols: int, std: float) -> np.ndarray:
    """Valid random stored bytes with values of roughly `std` (fast: no float weights made)."""
    nb = row_bytes(type_name, cols)
    if type_name in FLOAT_TYPES:
        return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * std, type_name)
    raw = np.frombuffer(rng.bytes(rows * nb), dtype=np.uint8).reshape(rows, nb).copy()
    _, bsize = BLOCK_BYTES[type_name]
    blocks = raw.reshape(-1, bsize)
    for off, scale in _RANDOM_SCALES[type_name]:
        val = np.float16(std * scale)
        blocks[:, off : off + 2] = np.frombuffer(val.tobytes(), dtype=np.uint8)
    return raw
