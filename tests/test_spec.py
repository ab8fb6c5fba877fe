"""Per-architecture choices read from GGUF metadata."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.gguf_file import read_gguf
from engine.spec import read_spec
from tests.models import GEMMA3, require

pytestmark = pytest.mark.timeout(60)


def test_gemma3_attention_scale_follows_query_pre_attn_scalar() -> None:
    """Gemma 3 scales attention by 1/sqrt(head_dim), except the 62-layer 27B by 1/sqrt(n_embd / n_heads)."""
    gf = read_gguf(str(require(GEMMA3)))
    spec = read_spec(gf)
    assert spec.attn_scale == 1.0 / math.sqrt(spec.head_dim)
    big = dataclasses.replace(gf, metadata={**gf.metadata, "gemma3.block_count": 62})
    spec27 = read_spec(big)
    assert spec27.attn_scale == 1.0 / math.sqrt(spec27.n_embd / spec27.n_heads)
    assert spec27.attn_scale != spec.attn_scale
    assert spec.traits.scale_q  # llama.cpp scales Q before its fp16 flash attention
