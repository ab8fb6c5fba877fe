"""The decode GEMVs' integer dot products (`engine.kernels.qdot_src`), compiled for the host.

A CI machine has no GPU, so without this the kernels' arithmetic (the K-quant scale unpacking,
the nibble and 6-bit masks, the 2-byte-aligned loads) would only ever be checked on a device. The
CUDA C of `quant_units.UNITS` + `qdot_src.QDOT` is compiled as C++ after `tests.cuda_host.HEADER`,
which stands in for the CUDA intrinsics it uses (`__dp4a`, `__funnelshift_r`, `__ldg`, `uint4`, ...;
`h2f` has its own host branch in UNITS), plus one entry point per chunk code that loads and dots every chunk of a
row the way one GEMV thread does (`ld_<C>` then `dot_<C>`). The integer sums are the device's
exactly; the few float operations after them may round differently where the GPU fuses a
multiply-add, so results are compared with a float tolerance.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from engine.kernels import qdot_src
from engine.kernels.quant_units import UNITS
from tests.cuda_host import HEADER, build

ENTRY = r"""
extern "C" void dots_{C}(const unsigned char* row, int nc, const signed char* xq, const float* xd,
                         const int* xs16, float* out) {
    for (int c = 0; c < nc; c++) { raw_{C} r; ld_{C}(row, c, r); out[c] = dot_{C}(r, c, xq, xd, xs16); }
}
"""

CODES = {"Q4_K": 32, "Q4_K2": 64, "Q6_K": 32, "Q6_K2": 64, "Q4_1": 32, "Q8_0": 32}
"""Every chunk code of `qdot_src` and the values one chunk holds."""
TYPE_OF = {"Q4_K": "Q4_K", "Q4_K2": "Q4_K", "Q6_K": "Q6_K", "Q6_K2": "Q6_K", "Q4_1": "Q4_1", "Q8_0": "Q8_0"}
"""The GGUF tensor type each chunk code reads."""
GROUP = {"Q4_K": 256, "Q6_K": 256, "Q4_1": 32, "Q8_0": 32}
"""Values per activation scale for each type: q8_k (256) for the K-quants, q8_0 (32) otherwise."""
PAD = 16
"""Bytes after a row: the 2-byte-aligned loads may read a word past the data (as on the GPU, where
CuPy's allocation rounding covers it)."""


def source() -> str:
    """The translation unit: CUDA's stand-ins (`tests.cuda_host.HEADER`), UNITS, QDOT and one entry
    point per code."""
    return HEADER + UNITS + qdot_src.QDOT + "".join(ENTRY.replace("{C}", c) for c in CODES)


class HostDots:
    """The compiled library: `dots(code, row, xq, xd, xs16)` -> one float per chunk of the row."""

    def __init__(self, folder: Path, cxx: str) -> None:
        self.lib = build(folder, source(), cxx, "qdot_host")
        for c in CODES:
            getattr(self.lib, f"dots_{c}").restype = None

    def dots(self, code: str, row: np.ndarray, xq: np.ndarray, xd: np.ndarray, xs16: np.ndarray) -> np.ndarray:
        """Every chunk's contribution of one stored row (uint8 bytes) against int8 activations
        `xq` with scales `xd` (one a rounding group) and per-16 sums `xs16`."""
        nc = xq.size // CODES[code]
        buf = aligned(row.size + PAD)
        buf[: row.size] = row
        out = np.zeros(nc, dtype=np.float32)
        xq = np.ascontiguousarray(xq, dtype=np.int8)
        xd = np.ascontiguousarray(xd, dtype=np.float32)
        xs16 = np.ascontiguousarray(xs16, dtype=np.int32)
        getattr(self.lib, f"dots_{code}")(
            ctypes.c_void_p(buf.ctypes.data),
            ctypes.c_int(nc),
            ctypes.c_void_p(xq.ctypes.data),
            ctypes.c_void_p(xd.ctypes.data),
            ctypes.c_void_p(xs16.ctypes.data),
            ctypes.c_void_p(out.ctypes.data),
        )
        return out


def chunk_values(code: str, cols: int) -> np.ndarray:
    """[chunks, values] the value indices each chunk of a row holds (`qdot_src`'s layout: a 32-value
    K-quant chunk is two runs of 16, a 64-value Q6_K chunk two runs of 32; the rest are contiguous)."""
    width = CODES[code]
    c = np.arange(cols // width)
    if code == "Q4_K":  # low nibbles: 16 values of sub-block 2j; high nibbles: the same 16 of 2j + 1
        k = c & 7
        starts = [(c >> 3) * 256 + 64 * (k >> 1) + 16 * (k & 1) + off for off in (0, 32)]
        run = 16
    elif code == "Q6_K":  # 16 values of quarter `pair` of a half, and the same 16 of quarter pair + 2
        k = c & 7
        starts = [(c >> 3) * 256 + 128 * (k >> 2) + 32 * ((k >> 1) & 1) + 16 * (k & 1) + off for off in (0, 64)]
        run = 16
    elif code == "Q6_K2":  # quarters `pair` and pair + 2 of one half
        j = c & 3
        starts = [(c >> 2) * 256 + 128 * (j >> 1) + 32 * (j & 1) + off for off in (0, 64)]
        run = 32
    else:
        starts, run = [c * width], width
    return np.concatenate([s0[:, None] + np.arange(run)[None, :] for s0 in starts], axis=1)


def aligned(n: int) -> np.ndarray:
    """n zero bytes starting at a 16-byte boundary (the 16-byte loads' alignment on the GPU)."""
    raw = np.zeros(n + 16, dtype=np.uint8)
    off = (-raw.ctypes.data) % 16
    return raw[off : off + n]


def activations(rng: np.random.Generator, cols: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random rounded activations as `qprep_x` leaves them: int8 values (the full -128..127 range,
    so every byte pattern meets the weights), one positive scale per `group` values, and the sum of
    each 16 values."""
    xq = rng.integers(-128, 128, size=cols, dtype=np.int16).astype(np.int8)
    xd = rng.uniform(0.001, 0.05, size=cols // group).astype(np.float32)
    xs16 = xq.astype(np.int32).reshape(-1, 16).sum(axis=1).astype(np.int32)
    return xq, xd, xs16


def stored_rows(rng: np.random.Generator, t: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Random stored rows of type `t` (`random_blocks`: every bit pattern) in a 16-byte aligned
    buffer padded as the GPU allocation is, their dequantized float64 values, and the bytes a row."""
    from engine.quants import dequantize
    from engine.quants_encode import random_blocks, row_bytes

    raw = random_blocks(rng, t, rows, cols, 0.05)
    buf = aligned(raw.size + PAD)
    buf[: raw.size] = raw.reshape(-1)
    vals = dequantize(raw.view(np.float32) if t == "F32" else raw, t, (rows, cols))  # F32: the bytes as floats
    return buf, vals.astype(np.float64), row_bytes(t, cols)
