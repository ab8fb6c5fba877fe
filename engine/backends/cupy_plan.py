"""What the CuPy backend allocates on the GPU, computed from the model's shape before load.

No CuPy here: `engine.model.plan_memory(..., backend="cupy")` runs anywhere (doctor, daemon
budget checks). `cupy_backend` allocates by the same constants (tile buffer, attention buffers,
prefill tile precision) and `cupy_decoder` by the same buffer list; `tests/test_cupy_memory.py`
checks the plan against CuPy's memory pool on a GPU.

Parts (bytes):
- weights: 2-D tensors as stored (block-quantized and float types alike); an untied
  `token_embd` stays on the host and does not count; 1-D tensors (norms, biases) as float32;
- kv: `kv_cache.kv_bytes`;
- tables: RoPE cos/sin, float32 [n_ctx, rope_dim / 2] per distinct RoPE base;
- decode scratch: the decode step's fixed buffers (`decode_scratch_bytes`);
- prefill scratch: the tile buffer (sized by the matrices that prefill through tiles: none where
  `mmq_h_<T>` multiplies every matrix in fp16, `mmq_device`, and no chunk is longer than
  `EngineOptions.cupy_mmq_tokens`), the attention buffers (float32 K/V rows for a non-f32 cache,
  the score block) and the activations of one chunk (`prefill_activation_bytes`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from ..gguf_file import GGUFFile
from ..kernels.mmq_src import MMQ_SPLIT_MAX, MMQ_SPLIT_ROWS, MMQ_SPLIT_T_MAX
from ..kv_cache import kv_bytes
from ..options import EngineOptions
from ..spec import ModelSpec

SCRATCH_ELEMS = 16 * 1024 * 1024
"""Values of one dequantized prefill tile at most: the tile buffer holds min(SCRATCH_ELEMS, the
largest matrix prefill multiplies) values of the widest tile element used (Qwen3-4B: 16M fp16
values, 32 MiB; SmolLM2: its 3072 x 576 gate+up in fp32, 6.75 MiB; the head only when a chunk
returns several rows of logits)."""
ATTN_SCORES_BYTES = 32 * 1024 * 1024
"""Prefill attention computes its scores [KV, query rows, keys] in blocks of query rows that fit
this buffer (one row at least); 32 MiB = 64 query positions of Qwen3-4B's shape at 4096 keys."""
PREFILL_CHUNK = 512
"""Prompt tokens per forward pass that `Model.generate` uses on this backend (the gate is
awaited between two chunks)."""
AUTO_F16_MIN_ELEMS = 4 * 1024 * 1024
"""prefill_dtype "auto": matrices of at least this many values use fp16 tiles (tensor cores);
smaller ones use fp32 (their GEMMs take microseconds either way and fp16 adds a conversion
launch per matmul, which costs more than it saves when prefill is host-bound)."""
FP32_TILE_TYPES = frozenset({"F32", "BF16"})
"""Stored types whose values need not fit fp16's range: "auto" keeps their tiles in fp32."""
PREFILL_DTYPES = ("auto", "float32", "float16")
POOL_SLACK = 1.0
"""Share of the chunk activations planned on top of their live peak for CuPy's pool, which keeps
freed blocks and splits larger ones for smaller requests (an allowance, checked on the GPU)."""
DECODE_MAX_SPLIT = 64
"""Upper bound of `CupyDecoder.n_split` (it is min(64, 2 x SMs / KV heads))."""
ARGMAX_BLOCKS = 64
"""Blocks of the decode step's argmax (`cupy_step`; `CupyDecoder.best_v` / `best_i` hold one value each)."""


def tile_rows(rows: int, cap: int) -> int:
    """Rows of each tile of a `rows`-row piece when the tile buffer holds `cap` rows: the fewest
    tiles that fit, of equal size rounded up to a multiple of 128 rows, so every tile's GEMM writes
    output columns at an aligned offset (an odd offset drops cuBLAS to slow kernels: Qwen3-4B's
    gate+up in 6,553-row tiles took 617 us at 512 tokens; whole, 146 us)."""
    if rows <= cap:
        return rows
    step = cap - cap % 128 if cap >= 128 else max(1, cap)
    n = -(-rows // step)
    each = -(-rows // n)
    return min(step, -(-each // 128) * 128) if step % 128 == 0 else each


def resolve_prefill_dtype(value: str | None, default: str = "auto") -> str:
    """The prefill tile precision: `value`, else `default` (`EngineOptions.cupy_prefill`), checked."""
    mode = value if value is not None else default
    if mode not in PREFILL_DTYPES:
        raise ValueError(f"prefill_dtype {mode!r}: expected one of {', '.join(PREFILL_DTYPES)}")
    return mode


def tile_dtype(mode: str, types: Iterable[str], rows: int, cols: int) -> str:
    """The tile precision ("float16" or "float32") of one matrix (`types`: its pieces' stored
    types) under prefill_dtype `mode`. "auto": fp16 for matrices of >= AUTO_F16_MIN_ELEMS values, except
    stored F32/BF16 (fp32 tiles, exact)."""
    if mode != "auto":
        return mode
    if FP32_TILE_TYPES.intersection(types) or rows * cols < AUTO_F16_MIN_ELEMS:
        return "float32"
    return "float16"


@dataclass(frozen=True)
class Matrix:
    """One matrix that prefill multiplies (fused as the backend fuses it)."""

    name: str
    types: frozenset[str]
    rows: int
    cols: int


def matrices(gf: GGUFFile, spec: ModelSpec) -> list[Matrix]:
    """Every matrix of a prefill pass: per layer QKV (fused), output, gate+up (fused), down; the head."""
    out: list[Matrix] = []
    e, hd, vd = spec.n_embd, spec.head_dim, spec.v_head_dim
    qkv_rows = spec.n_heads * hd + spec.n_kv_heads * (hd + vd)
    for i in range(spec.n_layers):
        p = f"blk.{i}."

        def types(*names: str, p: str = p) -> frozenset[str]:
            return frozenset(gf.tensors[p + n].type_name for n in names if p + n in gf.tensors)

        out += [
            Matrix(p + "qkv", types("attn_q.weight", "attn_k.weight", "attn_v.weight"), qkv_rows, e),
            Matrix(p + "attn_output", types("attn_output.weight"), e, spec.n_heads * vd),
            Matrix(p + "gate_up", types("ffn_gate.weight", "ffn_up.weight"), 2 * spec.n_ff, e),
            Matrix(p + "ffn_down", types("ffn_down.weight"), e, spec.n_ff),
        ]
    head = gf.tensors.get("output.weight") or gf.tensors["token_embd.weight"]
    out.append(Matrix("output", frozenset({head.type_name}), spec.n_vocab, e))
    return out


def weights_bytes(gf: GGUFFile) -> int:
    """Weights on the device: 2-D as stored, 1-D as float32; an untied token_embd stays on the host."""
    untied = "output.weight" in gf.tensors
    total = 0
    for t in gf.tensors.values():
        if len(t.shape) == 2:
            if not (untied and t.name == "token_embd.weight"):
                total += t.nbytes
        else:
            n = 1
            for s in t.shape:
                n *= int(s)
            total += 4 * n
    return total


def rope_table_bytes(spec: ModelSpec, n_ctx: int) -> int:
    """cos + sin, float32 [n_ctx, rope_dim / 2], per distinct RoPE base (Transformer.rope)."""
    half = min(spec.rope_dim, spec.head_dim) // 2
    bases = {spec.layer_rope_base(i) for i in range(spec.n_layers)}
    return len(bases) * 2 * n_ctx * half * 4


def rounded_input_bytes(cols: int) -> int:
    """A `QInput` of `cols` values: int8 values, a float scale per 32, an int32 sum per 16."""
    return cols + 4 * max(1, cols // 32) + 4 * max(1, cols // 16)


def decode_scratch_bytes(spec: ModelSpec, n_split: int = DECODE_MAX_SPLIT) -> int:
    """`CupyDecoder.scratch_bytes` from the shape: its fixed activation buffers (ids, x, tmp, qkv,
    q, attention output and split partials, gate/up, GLU output, logits, counters, argmax partials)
    and the rounded-input buffer (int8 values, a float scale per 32, an int32 sum per 16)."""
    e, hd, vd = spec.n_embd, spec.head_dim, spec.v_head_dim
    nh, nkv, ff = spec.n_heads, spec.n_kv_heads, spec.n_ff
    floats = (
        2 * e  # x, tmp
        + nh * hd
        + nkv * (hd + vd)  # qkv
        + nh * hd
        + nh * vd  # q, attn
        + 2 * nh * n_split
        + nh * n_split * vd  # pm, pl, pacc
        + 3 * ff  # gu, act
        + spec.n_vocab  # logits
        + ARGMAX_BLOCKS  # best_v
    )
    ints = 4 + (nkv + 1) + ARGMAX_BLOCKS  # ids, counters, best_i
    return 4 * (floats + ints) + rounded_input_bytes(max(e, ff, nh * vd))


def prefill_activation_bytes(
    spec: ModelSpec, chunk: int, last_n: int = 1, half: bool = True, split: bool = False
) -> int:
    """Live peak of one prefill chunk's activations (float32; `half`: fp16 copies of matrix inputs).

    Mirrors what `Transformer.forward` references: it drops every intermediate once used, so a
    layer step holds the residual x (two while `x + a` is formed) and the step's own temporaries
    (`widest`: the gate+up projection on most shapes: rounded input, fp16 input, [T, 2F] output,
    plus the GLU output). The head adds the last `last_n` rows' norm, rounding and logits.
    `split`: the GEMMs of chunks of <= MMQ_SPLIT_T_MAX tokens may split K (`mmq_splits`), each
    holding its input, output and slices at once; the peak of such a chunk counts too.
    """
    peak = _activation_bytes(spec, chunk, last_n, half, False)
    if split:
        peak = max(peak, _activation_bytes(spec, min(chunk, MMQ_SPLIT_T_MAX), last_n, half, True))
    return peak


def _activation_bytes(spec: ModelSpec, chunk: int, last_n: int, half: bool, split: bool) -> int:
    e, r = spec.n_embd, spec.n_heads * spec.head_dim + spec.n_kv_heads * (spec.head_dim + spec.v_head_dim)
    q, kvd, a, f = (
        spec.n_heads * spec.head_dim,
        spec.n_kv_heads * spec.head_dim,
        spec.n_heads * spec.v_head_dim,
        spec.n_ff,
    )
    xh = 0.5 if half else 0.0
    carried = 2 * e
    widest = max(
        (1 + xh) * e + r,  # QKV projection (rounded + fp16 input, output)
        q,  # Q norm / RoPE copies
        r + 2 * q + kvd + 2 * a,  # attention: qkv, rotated q and k, q laid out by KV head, output twice
        (1 + xh) * e + 3 * f,  # gate+up projection, then the GLU output beside it
        (1 + xh) * f + e,  # down projection
    )
    if split:  # each GEMM beside its split-K slices (`mmq_splits`: a piece of p rows keeps at most
        # p x min(8, MMQ_SPLIT_ROWS // p) values a token, none past MMQ_SPLIT_ROWS // 2 rows); QKV's
        # pieces are runs of Q, K and V (any may be short), gate+up's are F rows each or one of 2F
        glu = MMQ_SPLIT_ROWS if f <= MMQ_SPLIT_ROWS // 2 else 0
        widest = max(
            widest,
            (1 + xh) * e + r + MMQ_SPLIT_ROWS,
            (1 + xh) * a + e + _split_rows(e),
            (1 + xh) * e + 2 * f + glu,
            (1 + xh) * f + e + _split_rows(e),
        )
    head = last_n * ((2 + xh) * e + spec.n_vocab)
    return int(4 * (chunk * (carried + widest) + head))


def attention_buffer_bytes(spec: ModelSpec, n_ctx: int, kv_dtype: str) -> tuple[int, int]:
    """(K/V rows, scores) of prefill attention (`cupy_attention.AttnBuffers`): float32 K/V of one
    layer [KV, n_ctx, D] - none for an f32 cache (read in place), one fixed buffer for f16 and
    int8 (converted / dequantized into it) - and the score block (`score_elems`)."""
    rows = 4 * spec.n_kv_heads * n_ctx * (spec.head_dim + spec.v_head_dim)
    rows *= 0 if kv_dtype == "f32" else 1
    return rows, 4 * score_elems(spec.n_kv_heads, n_ctx, spec.n_heads // spec.n_kv_heads)


def score_elems(n_kv: int, n_ctx: int, group: int = 1) -> int:
    """Values of the prefill attention score block (see ATTN_SCORES_BYTES); at least one query
    row of every head of a GQA group of `group` over n_ctx keys."""
    return max(n_kv * group * n_ctx, min(ATTN_SCORES_BYTES // 4, n_kv * n_ctx * n_ctx))


GRAPH_MAX_WEIGHTS = 1 << 30
"""Models with fewer weight bytes (host-bound prefill) get first-chunk graphs
(`EngineOptions.cupy_prefill_graph`, env GENIE_CUPY_PREFILL_GRAPH: 0 never, 1 always, unset: by
this size)."""


def prefill_graph_buckets(
    weights: int, chunk: int, n_ctx: int, forced: bool | None = None, mmq_tokens: int | None = None
) -> tuple[tuple[int, ...], int]:
    """The first-chunk lengths a model of `weights` bytes replays from graphs (empty: none) and the
    shortest first chunk that takes one: one bucket, the chunk (a shorter first chunk is padded to
    it: for a host-bound pass a padded graph replay costs less than the eager pass of even a few
    tokens, and one bucket holds one chunk's activations). `forced` False: none; True: whatever the
    size, from 2 tokens; None: models below GRAPH_MAX_WEIGHTS from 2 tokens, larger ones only for
    chunks longer than `mmq_tokens` (their GEMMs then run as fp16 tiles + cuBLAS, GPU-fast enough
    that issuing the pass's ~900 launches is what it waits for: Qwen3-4B's shape at 512 tokens, 21
    ms of GPU work against 31-55 ms of host time; a shorter chunk keeps the eager mmq pass, never
    padded more than chunk / `mmq_tokens` times). `mmq_tokens` None: no mmq (tiles for every chunk)."""
    n = min(chunk, n_ctx)
    if forced is False or n < 2:
        return (), 0
    if forced or weights < GRAPH_MAX_WEIGHTS:
        return (n,), 2
    shortest = 2 if mmq_tokens is None else mmq_tokens + 1
    return ((n,), shortest) if n >= shortest else ((), 0)


LATER_GRAPH_MAX = 128
"""Longest later prefill chunk replayed from graphs (`cupy_prefill_graph`, later chunks): up to it
a pass's ~700 launches (20-45 ms of Python for a 4B model) cost as much as its GPU work or more
(a 72-token question after 1,987 positions: 17.9 ms on an H200), and the shared pool stays small."""


def later_graph_max(chunk: int, n_ctx: int, forced: bool | None = None) -> int:
    """The longest later chunk (start > 0) replayed from graphs: LATER_GRAPH_MAX, or the chunk or
    n_ctx where smaller; 0 (none) where graphs are forced off."""
    if forced is False:
        return 0
    n = min(chunk, n_ctx, LATER_GRAPH_MAX)
    return n if n >= 2 else 0


def _split_rows(rows: int) -> int:
    """The most split-K slice values a token of a one-piece matrix of `rows` rows (`mmq_splits`)."""
    n = min(MMQ_SPLIT_MAX, MMQ_SPLIT_ROWS // rows)
    return rows * n if n >= 2 else 0


def later_pool_bytes(spec: ModelSpec, later: int, half: bool, split: bool) -> int:
    """The later-chunk graphs' shared pool: one `later`-token chunk's activations + POOL_SLACK
    (`cupy_prefill_graph` reserves it at the first capture)."""
    return int(prefill_activation_bytes(spec, later, 1, half, split) * (1 + POOL_SLACK)) if later else 0


def later_graph_bytes(spec: ModelSpec, later: int, half: bool, split: bool) -> int:
    """What the later-chunk graphs hold: their pool and their float32 input rows [later, E]."""
    return later_pool_bytes(spec, later, half, split) + 4 * later * spec.n_embd if later else 0


@dataclass(frozen=True)
class GpuPlan:
    """The parts of the CuPy backend's plan (bytes)."""

    weights: int
    kv: int
    tables: int
    decode_scratch: int
    tiles: int
    kv_rows: int
    scores: int
    activations: int
    """Chunk activations' live peak plus POOL_SLACK."""
    chunk: int
    prefill_dtype: str
    graphs: int = 0
    """The prefill graphs' pools: one chunk's activations per first-chunk bucket and one
    `later_graph_max` chunk's for the later chunks' shared pool (+ POOL_SLACK)."""

    @property
    def prefill_scratch(self) -> int:
        return self.tiles + self.kv_rows + self.scores + self.activations + self.graphs


def mmq_device() -> bool:
    """Whether the GPU runs `mmq_h_<T>` (`mma.sync` for fp16: compute capability 8.0+, Ampere,
    Orin sm_87, Hopper) where CuPy is already loaded with a device (the backend's own test, so the
    plan and `CupyOps.mmq` agree); True otherwise: a plan made from the header alone (`models
    plan`) is for the target box."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return True
    try:
        return int(cp.cuda.Device().compute_capability) >= 80
    except Exception:  # no device or no driver here: plan for the target
        return True


def plan(
    gf: GGUFFile,
    spec: ModelSpec,
    n_ctx: int,
    kv_dtype: str,
    chunk: int = PREFILL_CHUNK,
    last_n: int = 1,
    prefill_dtype: str | None = None,
    options: EngineOptions | None = None,
) -> GpuPlan:
    """The CuPy backend's memory for this model at `n_ctx`, prefill chunks of <= `chunk` tokens
    returning <= `last_n` rows of logits (Model.generate: 1), under `options` (None: the
    environment's, as `engine.load_model` without options); `prefill_dtype` overrides theirs."""
    opts = options if options is not None else EngineOptions.from_env()
    mode = resolve_prefill_dtype(prefill_dtype, opts.cupy_prefill)
    typed = [
        (m, tile_dtype(mode, m.types, m.rows, m.cols)) for m in matrices(gf, spec) if m.name != "output" or last_n > 1
    ]
    dts = {dt for _, dt in typed}
    itemsize = 4 if "float32" in dts else 2
    mmq = opts.cupy_mmq and mmq_device()  # fp16 matrices: `mmq_h_<T>`, no tile, for chunks of <= cupy_mmq_tokens
    t = min(chunk, n_ctx)
    tiled = not mmq or t > opts.cupy_mmq_tokens
    elems = min(SCRATCH_ELEMS, max((m.rows * m.cols for m, dt in typed if tiled or dt == "float32"), default=0))
    kv_rows, scores = attention_buffer_bytes(spec, n_ctx, kv_dtype)
    split = mmq and opts.cupy_mmq_split and "float16" in dts
    act = prefill_activation_bytes(spec, t, last_n, half="float16" in dts, split=split)
    w = weights_bytes(gf)
    buckets, _ = prefill_graph_buckets(w, chunk, n_ctx, opts.cupy_prefill_graph, opts.cupy_mmq_tokens if mmq else None)
    first = sum(prefill_activation_bytes(spec, b, 1, half="float16" in dts, split=split) for b in buckets)
    later = later_graph_max(chunk, n_ctx, opts.cupy_prefill_graph)
    graphs = int(first * (1 + POOL_SLACK)) + later_graph_bytes(spec, later, "float16" in dts, split)
    return GpuPlan(
        weights=w,
        kv=kv_bytes(spec, n_ctx, kv_dtype),
        graphs=graphs,
        tables=rope_table_bytes(spec, n_ctx),
        decode_scratch=decode_scratch_bytes(spec),
        tiles=elems * itemsize,
        kv_rows=kv_rows,
        scores=scores,
        activations=int(act * (1 + POOL_SLACK)),
        chunk=t,
        prefill_dtype=mode,
    )
