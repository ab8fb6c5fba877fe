"""What the CuPy test modules share: the small synthetic model shape, the architecture x weight
type cases whole models are checked on, and the relative error they bound (no CuPy needed here;
the `act_mode` fixture is in conftest.py)."""

from __future__ import annotations

import numpy as np

SHAPE = dict(n_layers=3, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, n_vocab=512)
"""A 3-layer GQA model, small enough to run every case in seconds."""
MODEL_CASES = [
    ("llama", "Q4_1", {}),
    ("llama", "F16", {}),
    ("llama", "Q5_0", {"tied": False}),
    ("qwen2", "Q8_0", {}),
    ("qwen2", "Q5_1", {}),
    ("qwen2", "BF16", {}),
    ("qwen3", "Q4_K", {"head_dim": 128}),
    ("qwen3", "Q6_K", {}),
    ("qwen3", "Q4_0", {}),
    ("gemma3", "Q5_K", {"sliding_window": 16, "n_layers": 6}),
    ("gemma3", "F32", {"sliding_window": 16}),
]
"""(architecture, weight type, extra synth arguments): every architecture and weight family."""


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """|a - b| / |b| (Frobenius norms, in float64)."""
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
