"""Our NumPy dequantizers agree exactly with the gguf package's reference implementation."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.quants import BLOCK_BYTES, dequantize

T = gguf.GGMLQuantizationType


def _random_blocks(type_name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes in the block layout, with finite fp16 scales where the format has them."""
    rng = np.random.default_rng(seed)
    _, size = BLOCK_BYTES[type_name]
    raw = rng.integers(0, 256, (rows * blocks_per_row, size), dtype=np.uint8)
    scale_at = {"Q6_K": [208]}.get(type_name, [0, 2] if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for off in scale_at:
        raw[:, off : off + 2] = (
            rng.uniform(-0.05, 0.05, rows * blocks_per_row).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    return raw.reshape(rows, blocks_per_row * size)


@pytest.mark.parametrize("type_name", sorted(BLOCK_BYTES))
def test_dequantize_matches_gguf_reference(type_name: str) -> None:
    """Every block type decodes bit-identically to gguf.quants.dequantize on random blocks."""
    block, _ = BLOCK_BYTES[type_name]
    raw = _random_blocks(type_name, 7, 3, seed=len(type_name))
    ours = dequantize(raw, type_name, (7, 3 * block))
    ref = gguf.quants.dequantize(raw, T[type_name])
    np.testing.assert_array_equal(ours, ref.reshape(ours.shape))


@pytest.mark.parametrize("type_name", ["F16", "BF16"])
def test_float_types_round_trip(type_name: str) -> None:
    """F16 and BF16 tensors decode to the values they encode."""
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    raw = gguf.quants.quantize(x, T[type_name])
    np.testing.assert_array_equal(dequantize(raw, type_name, x.shape), gguf.quants.dequantize(raw, T[type_name]))
