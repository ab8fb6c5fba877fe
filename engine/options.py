"""Engine tuning options: one frozen value passed to `engine.load_model`, built from the
environment by `EngineOptions.from_env` (the only place the engine reads these variables).

| field | env var | default | effect |
| --- | --- | --- | --- |
| `threads` | `GENIE_THREADS`, else `OMP_NUM_THREADS` | None (all cores) | native CPU kernels' threads |
| `native_cflags` | `GENIE_NATIVE_CFLAGS` (split on whitespace) | () | extra C compiler flags of the native kernels |
| `qgemv_unroll` | `GENIE_QGEMV_UNROLL` | 2 | chunks a thread of `qgemv_<T>` loads at once |
| `qgemv_unroll_glu` | `GENIE_QGEMV_UNROLL_GLU` | 1 | the same for each row of `qgemv_glu_<T>` |
| `qgemv_min_blocks` | `GENIE_QGEMV_MIN_BLOCKS` | 0 (the rule) | blocks of 256 threads an SM every integer decode GEMV is held to (launch bounds: fewer registers, maybe spills) |
| `qgemv_row_budget` | `GENIE_QGEMV_ROW_BUDGET` | 0 (5) | row groups an SM the integer decode GEMVs' threads a row are chosen for (`qgemv_config`: the most threads a row that keep the grid within this many blocks an SM) |
| `cupy_pdl` | `GENIE_CUPY_PDL` (`0`: off) | True | programmatic dependent launch in the decode step |
| `cupy_prefill` | `GENIE_CUPY_PREFILL` | "auto" | prefill tile precision: auto, float16, float32 |
| `cupy_mmq` | `GENIE_CUPY_MMQ` (`0`: off) | True | fp16 prefill GEMMs read the GGUF blocks (`mmq_h_<T>` / `mmq_w_<T>`, sm_80+) instead of dequantized tiles + cuBLAS |
| `cupy_mmq_tokens` | `GENIE_CUPY_MMQ_TOKENS` | 128 | the longest chunk the mmq GEMMs take; longer: fp16 tiles + cuBLAS |
| `cupy_mmq_i8` | `GENIE_CUPY_MMQ_I8` (`1`: on) | False | Q4_K prefill GEMMs multiply int8 (the chunk rounded to q8_k, `mmq_i8_<T>`: llama.cpp's MMQ arithmetic) instead of fp16 |
| `cupy_mmq_split` | `GENIE_CUPY_MMQ_SPLIT` (`0`: off) | True | chunks of <= 128 tokens split the mmq GEMMs' K over blocks where the grid would not fill the GPU |
| `cupy_prefill_graph` | `GENIE_CUPY_PREFILL_GRAPH` (`0`/`1`) | None (by model size) | prefill graphs: `0` none, `1` first chunks of every model, unset: first chunks of models < 1 GiB, and larger models' first chunks longer than `cupy_mmq_tokens` unless prefilled in layer groups; later chunks of <= 128 tokens either way unless `0` |
| `cupy_decoder` | `GENIE_CUPY_DECODER` | "graph" | one-token steps: graph, eager or off |
| `cupy_device_loop` | `GENIE_CUPY_DEVICE_LOOP` (`0`: off) | True | decode steps chained on the device, tokens read one step behind |
| `attn_chunk` | `GENIE_CUPY_ATTN_CHUNK` | 32 | fewest positions a decode-attention slice takes |
| `attn_warps` | `GENIE_CUPY_ATTN_WARPS` | 0 (the rule) | warps of a decode-attention block |
| `attn_cluster` | `GENIE_CUPY_ATTN_CLUSTER` | 8 | sm_90+: blocks of the thread-block cluster that takes one KV head's positions in decode attention (merged through distributed shared memory); 0: split-K slices merged through global memory (always below sm_90) |
| `prefill_chunk` | — (the caller's) | None (the backend's: CPU 64, CuPy 512) | prompt tokens per prefill pass the caller uses: sizes the memory plan's prefill scratch and CuPy's first-chunk graph |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    """The engine's tuning knobs, fixed for one loaded model (defaults: the measured best)."""

    threads: int | None = None
    """Threads of the native CPU kernels; None: every core (an explicit `load_model(threads=)` wins)."""
    native_cflags: tuple[str, ...] = ()
    """Extra C compiler flags of the native CPU kernels (experiments; part of the build cache key)."""
    qgemv_unroll: int = 2
    """Chunks a thread of `qgemv_<T>` loads at once (2 beats 4 and 8 with weights from DRAM)."""
    qgemv_unroll_glu: int = 1
    """Chunks each of the two rows of `qgemv_glu_<T>` loads at once."""
    qgemv_min_blocks: int = 0
    """Blocks of 256 threads an SM that every integer decode GEMV is held to (`__launch_bounds__`,
    for tuning: fewer registers a thread, maybe spills); 0: the built-in rule (5 for the 64-value
    K-quant kernels at the default unroll: 48 registers; none for the others)."""
    qgemv_row_budget: int = 0
    """Row groups of 256 threads an SM that `qgemv_config` sizes the integer GEMVs' threads a row
    for (the most threads a row whose grid stays within it); 0: 5, the kernels' resident blocks.
    Measured at 5 (session 39: 3, 4, 8, 10 gave 0.80-1.00x)."""
    cupy_pdl: bool = True
    """Whether the CUDA decode step uses programmatic dependent launch where the device has it."""
    cupy_prefill: str = "auto"
    """CuPy prefill tile precision: "auto", "float16" or "float32" (checked when used)."""
    cupy_mmq: bool = True
    """Whether CuPy prefill multiplies fp16-precision matrices with `mmq_h_<T>` / `mmq_w_<T>` (the GGUF blocks
    decoded inside the GEMM, sm_80+) rather than dequantized tiles and cuBLAS."""
    cupy_mmq_tokens: int = 128
    """The longest chunk whose fp16-precision GEMMs `mmq_h_<T>` multiplies; longer chunks dequantize
    the matrix into fp16 tiles and multiply them with cuBLAS (tensor cores at full rate: on the H200
    3x faster at 512 tokens; the mmq kernels read each weight once, which wins on short chunks)."""
    cupy_mmq_i8: bool = False
    """Whether CuPy prefill multiplies Q4_K matrices in int8 (`mmq_i8_<T>`: the chunk's rows rounded to
    q8_k as int8, exact integer products per sub-block) rather than fp16 `mmq_h_<T>` (needs `cupy_mmq`; chunks of at
    most `cupy_mmq_tokens`)."""
    cupy_mmq_split: bool = True
    """Whether chunks of <= 128 tokens split the mmq GEMMs' K over blocks where their grid would
    leave the GPU half idle (`mmq_src.mmq_splits`); False: never (other summation order: bits differ)."""
    cupy_prefill_graph: bool | None = None
    """Prefill graphs: False never; first chunks always (True) or by model size (None); later
    chunks (start > 0, <= 128 tokens, `cupy_prefill_graph` module doc) unless False."""
    cupy_decoder: str = "graph"
    """CuPy one-token steps: "graph" (replayed CUDA graph), "eager" (same kernels) or "off"."""
    cupy_device_loop: bool = True
    """Whether `Model.generate` chains CUDA decode steps on the device (the next step reads the
    previous one's token from device memory; the host reads tokens one step behind)."""
    attn_chunk: int = 32
    """Fewest positions one decode-attention slice takes."""
    attn_warps: int = 0
    """Warps of one decode-attention block; 0: `decode_src.attn_warps`'s rule."""
    attn_cluster: int = 8
    """On sm_90+, the blocks of one thread-block cluster that take a KV head's positions in decode
    attention and merge through distributed shared memory (at most 8); 0: split-K slices of at
    least `attn_chunk` positions merged through global memory, the only path below sm_90."""
    prefill_chunk: int | None = None
    """Prompt tokens per prefill pass the caller will use (the daemon: the policy's
    `voice.prefill_chunk_tokens`); sizes the plan's prefill scratch and CuPy's first-chunk graph.
    None: the backend's own (CPU 64, CuPy 512)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> EngineOptions:
        """The options that the variables of `environ` set (the table above), defaults elsewhere."""
        env = environ
        threads_s = env.get("GENIE_THREADS") or env.get("OMP_NUM_THREADS")
        threads = int(threads_s) if threads_s and threads_s.strip().isdigit() and int(threads_s) > 0 else None
        graph = env.get("GENIE_CUPY_PREFILL_GRAPH", "")
        return cls(
            threads=threads,
            native_cflags=tuple(env.get("GENIE_NATIVE_CFLAGS", "").split()),
            qgemv_unroll=int(env.get("GENIE_QGEMV_UNROLL", "2")),
            qgemv_unroll_glu=int(env.get("GENIE_QGEMV_UNROLL_GLU", "1")),
            qgemv_min_blocks=int(env.get("GENIE_QGEMV_MIN_BLOCKS", "0")),
            qgemv_row_budget=int(env.get("GENIE_QGEMV_ROW_BUDGET", "0")),
            cupy_pdl=env.get("GENIE_CUPY_PDL", "1") != "0",
            cupy_prefill=env.get("GENIE_CUPY_PREFILL", "auto"),
            cupy_mmq=env.get("GENIE_CUPY_MMQ", "1") != "0",
            cupy_mmq_tokens=int(env.get("GENIE_CUPY_MMQ_TOKENS", "128")),
            cupy_mmq_i8=env.get("GENIE_CUPY_MMQ_I8", "0") == "1",
            cupy_mmq_split=env.get("GENIE_CUPY_MMQ_SPLIT", "1") != "0",
            cupy_prefill_graph={"0": False, "1": True}.get(graph),
            cupy_decoder=env.get("GENIE_CUPY_DECODER", "graph"),
            cupy_device_loop=env.get("GENIE_CUPY_DEVICE_LOOP", "1") != "0",
            attn_chunk=int(env.get("GENIE_CUPY_ATTN_CHUNK", "32")),
            attn_warps=int(env.get("GENIE_CUPY_ATTN_WARPS", "0")),
            attn_cluster=int(env.get("GENIE_CUPY_ATTN_CLUSTER", "8")),
        )


DEFAULT_OPTIONS = EngineOptions()
"""The defaults, for callers below `load_model` that were given no options."""
