"""The memory plan of the CuPy backend, computed on any machine (no CUDA), and the prefill chunk
a generation picks. The plan against CuPy's real pool: tests/test_cupy_memory.py (GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from engine import SamplingParams, load_model
from engine.backends import cupy_plan
from engine.generate import DEFAULT_PREFILL_CHUNK
from engine.gguf_file import read_gguf
from engine.kv_cache import kv_bytes
from engine.model import plan_memory
from engine.spec import read_spec
from engine.synth import write_synthetic_gguf

pytestmark = pytest.mark.timeout(120)

SHAPE = dict(n_layers=3, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, n_vocab=512)


def _model(tmp_path: Path, **kw: object) -> str:
    return write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", seed=1, **{**SHAPE, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("tied", [True, False])
def test_cupy_plan_counts_weights_as_stored(tmp_path: Path, tied: bool) -> None:
    """2-D tensors at their stored bytes, 1-D as float32, an untied token_embd not at all (it
    stays on the host); KV from kv_bytes; the parts add up to the total."""
    gf = read_gguf(_model(tmp_path, weight_type="Q4_K", tied=tied))
    spec = read_spec(gf)
    plan = plan_memory(gf, spec, 1024, "f16", backend="cupy")
    want = 0
    for t in gf.tensors.values():
        if len(t.shape) == 1:
            want += 4 * int(np.prod(t.shape))
        elif tied or t.name != "token_embd.weight":
            want += t.nbytes
    assert plan.weights == want
    assert plan.kv == kv_bytes(spec, 1024, "f16")
    assert plan.backend == "cupy" and plan.chunk == cupy_plan.PREFILL_CHUNK
    assert plan.total == plan.weights + plan.kv + plan.decode_scratch + plan.prefill_scratch + plan.tables
    assert plan.scratch == plan.total - plan.weights - plan.kv
    assert sum(b for _, b in plan.parts) == plan.prefill_scratch


def test_cupy_plan_of_a_4b_shape_is_gpu_sized() -> None:
    """Qwen3-4B's shape (Q4_K_M sizes, read from a header-only stand-in) plans ~3.3 GB at 4096
    context with an f16 cache, not the float32 CPU figure (~16.7 GB)."""
    from engine.gguf_file import GGUFFile, TensorInfo
    from engine.synth import PRESETS, _tensor_list, preset_config

    c = preset_config("qwen3-4b-q4_k_m")
    block = {"Q4_K": (256, 144), "Q6_K": (256, 210), "F32": (1, 4)}
    tensors = {}
    for name, shape, _kind in _tensor_list(c):
        t = "F32" if len(shape) == 1 else str(c.type_overrides.get(name, c.weight_type))
        per, size = block[t]
        # a zero-stride stand-in: the right nbytes, no memory
        raw = np.broadcast_to(np.uint8(0), (shape[0], shape[-1] // per * size) if len(shape) == 2 else (shape[0] * 4,))
        tensors[name] = TensorInfo(name, t, tuple(shape), raw)
    meta: dict[str, Any] = {"general.architecture": "qwen3", "general.name": "x"}
    p = PRESETS["qwen3-4b-q4_k_m"]
    for k, v in {
        "block_count": p["n_layers"],
        "context_length": 40960,
        "embedding_length": p["n_embd"],
        "feed_forward_length": p["n_ff"],
        "attention.head_count": p["n_heads"],
        "attention.head_count_kv": p["n_kv_heads"],
        "attention.key_length": 128,
        "attention.value_length": 128,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1e6,
    }.items():
        meta[f"qwen3.{k}"] = v
    gf = GGUFFile("qwen3-4b-shape", meta, tensors)
    spec = read_spec(gf)
    plan = plan_memory(gf, spec, 4096, "f16", backend="cupy", prefill_dtype="auto")
    cpu = plan_memory(gf, spec, 4096, "f16")
    mib = 2**20
    sizes = {"weights": plan.weights, "kv": plan.kv, "decode": plan.decode_scratch}
    sizes |= {"prefill": plan.prefill_scratch, "total": plan.total, "cpu_total": cpu.total}
    print({k: round(v / mib, 1) for k, v in sizes.items()}, {k: round(v / mib, 1) for k, v in plan.parts})
    assert 2300 * mib < plan.weights < 2450 * mib  # ~2.49 GB of blocks
    assert plan.kv == 576 * mib
    assert 3.0e9 < plan.total < 3.6e9 and cpu.total > 15e9
    parts = dict(plan.parts)
    # 512-token chunks: every matrix (>= 4M values: fp16) in 16M-value tiles for cuBLAS
    assert parts["prefill_tiles"] == cupy_plan.SCRATCH_ELEMS * 2
    short = dict(plan_memory(gf, spec, 4096, "f16", backend="cupy", prefill_dtype="auto", chunk=128).parts)
    assert short["prefill_tiles"] == 0  # chunks of <= cupy_mmq_tokens: mmq_h_<T> reads the blocks, no tile
    # a 512-token first chunk replays a graph (its pool: one chunk's activations); 128: none
    assert parts["prefill_graphs"] - short["prefill_graphs"] > parts["prefill_activations"] / 2
    assert parts["prefill_scores"] == cupy_plan.ATTN_SCORES_BYTES
    assert parts["prefill_kv_rows"] == 32 * mib  # f16 cache: one layer's K/V as float32


def test_tile_precision_rule() -> None:
    """auto: fp16 tiles for matrices of >= 4M values, fp32 for smaller ones and for stored
    F32/BF16; explicit modes apply everywhere."""
    assert cupy_plan.tile_dtype("auto", {"Q4_K"}, 19456, 2560) == "float16"
    assert cupy_plan.tile_dtype("auto", {"Q4_K", "Q6_K"}, 6144, 2560) == "float16"
    assert cupy_plan.tile_dtype("auto", {"Q4_1"}, 3072, 576) == "float32"  # SmolLM2's gate+up
    assert cupy_plan.tile_dtype("auto", {"BF16"}, 19456, 2560) == "float32"
    assert cupy_plan.tile_dtype("auto", {"F16"}, 19456, 2560) == "float16"
    assert cupy_plan.tile_dtype("float16", {"F32"}, 8, 32) == "float16"
    assert cupy_plan.tile_dtype("float32", {"Q4_K"}, 19456, 2560) == "float32"
    with pytest.raises(ValueError, match="prefill_dtype"):
        cupy_plan.resolve_prefill_dtype("bf16")


def test_tiles_are_even_and_aligned() -> None:
    """A piece longer than the tile buffer is cut into the fewest tiles that fit, of equal size
    rounded up to 128 rows (aligned output columns for cuBLAS), covering every row once."""
    for rows, cap in ((19456, 6553), (9728, 6553), (2560, 4096), (5120, 300), (1000, 50), (129, 128), (640, 128)):
        t = cupy_plan.tile_rows(rows, cap)
        n = -(-rows // t)
        assert t <= cap and n * t >= rows > (n - 1) * t, (rows, cap, t)
        if rows > cap >= 128:
            assert t % 128 == 0 and n == -(-rows // (cap - cap % 128)), (rows, cap, t)
    assert cupy_plan.tile_rows(19456, 6553) == 6528  # 3 tiles, not 6553 + 6553 + 6350 at odd offsets
    assert cupy_plan.tile_rows(2560, 4096) == 2560


def test_first_chunk_graph_rule() -> None:
    """Small models replay every first chunk from a graph; larger ones only chunks longer than
    `cupy_mmq_tokens` (tiles + cuBLAS, host-bound); forcing overrides both ways."""
    small, big = 100 << 20, 3 << 30
    assert cupy_plan.prefill_graph_buckets(small, 512, 4096, None, 128) == ((512,), 2)
    assert cupy_plan.prefill_graph_buckets(big, 512, 4096, None, 128) == ((512,), 129)
    assert cupy_plan.prefill_graph_buckets(big, 128, 4096, None, 128) == ((), 0)  # the policies' chunks
    assert cupy_plan.prefill_graph_buckets(big, 512, 100, None, 128) == ((), 0)  # n_ctx caps the chunk
    assert cupy_plan.prefill_graph_buckets(big, 512, 4096, None, None) == ((512,), 2)  # no mmq: all tiles
    assert cupy_plan.prefill_graph_buckets(big, 512, 4096, True, 128) == ((512,), 2)
    assert cupy_plan.prefill_graph_buckets(small, 512, 4096, False, 128) == ((), 0)


def test_attention_score_block_is_bounded() -> None:
    """The score block never exceeds ATTN_SCORES_BYTES (but holds one query row)."""
    assert cupy_plan.score_elems(8, 4096) * 4 == cupy_plan.ATTN_SCORES_BYTES
    assert cupy_plan.score_elems(2, 128) == 2 * 128 * 128  # small contexts: what they need
    assert cupy_plan.score_elems(64, 262144) == 64 * 262144  # one row when even that is larger


def _collect_prefill_waits(model: Any, prompt: list[int], **kw: Any) -> tuple[int, int]:
    calls: list[str] = []

    class CountingGate:
        async def wait(self, phase: str) -> None:
            calls.append(phase)

    async def run() -> int:
        g = model.generate(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), CountingGate(), **kw)
        async for _ in g:
            pass
        return g.prefill_chunk

    model.transformer.kv.tokens = []
    chunk = anyio.run(run)
    return chunk, calls.count("prefill")


def test_generate_uses_the_backends_prefill_chunk(tmp_path: Path) -> None:
    """Without a caller or gate chunk, generation prefills in the backend's chunks (its ops'
    `prefill_chunk`; 64 where it has none) and awaits the gate before each of them."""
    m = load_model(_model(tmp_path, weight_type="Q8_0"), backend="numpy", n_ctx=256)
    prompt = np.random.default_rng(0).integers(0, 512, 40).tolist()
    assert m.transformer.ops.prefill_chunk is None  # the backend declares no preference
    assert _collect_prefill_waits(m, prompt) == (DEFAULT_PREFILL_CHUNK, 1)
    m.transformer.ops.prefill_chunk = 16  # what CupyOps advertises (512)
    assert _collect_prefill_waits(m, prompt) == (16, 3)
    assert _collect_prefill_waits(m, prompt, prefill_chunk=8) == (8, 5)  # the caller's wins
