"""Engine options: `EngineOptions.from_env` parses every variable, `load_model(options=...)` reaches
the backend, the kernel sources follow the options, and no other engine module reads the environment."""

from __future__ import annotations

import re
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from engine import EngineOptions, load_model
from engine.backends.cpu_native import native_available
from engine.gguf_file import read_gguf
from engine.kernels import decode_src, qdot_src
from engine.kernels.mmq_src import MMQ_SPLIT_ROWS, mmq_splits, mmq_tile
from engine.model import plan_memory
from engine.spec import read_spec
from engine.synth import write_synthetic_gguf

SHAPE = dict(n_layers=2, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, n_vocab=300)
ENGINE = Path(__file__).resolve().parents[1] / "engine"


VARIABLES = (
    "GENIE_THREADS",
    "OMP_NUM_THREADS",
    "GENIE_NATIVE_CFLAGS",
    "GENIE_QGEMV_UNROLL",
    "GENIE_QGEMV_UNROLL_GLU",
    "GENIE_QGEMV_MIN_BLOCKS",
    "GENIE_CUPY_PDL",
    "GENIE_CUPY_PREFILL",
    "GENIE_CUPY_PREFILL_GRAPH",
    "GENIE_CUPY_DECODER",
    "GENIE_CUPY_DEVICE_LOOP",
    "GENIE_CUPY_ATTN_CHUNK",
    "GENIE_CUPY_ATTN_WARPS",
    "GENIE_CUPY_ATTN_CLUSTER",
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without any of the engine's variables (the caller's shell may set some)."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _model(tmp_path: Path) -> str:
    return write_synthetic_gguf(tmp_path / "m.gguf", "qwen3", weight_type="Q8_0", seed=1, **SHAPE)  # type: ignore[arg-type]


def test_defaults_are_the_engines_and_the_value_is_frozen() -> None:
    """An empty environment gives the defaults (the engine's measured best); options cannot change once made."""
    o = EngineOptions.from_env({})
    assert o == EngineOptions()
    assert (o.threads, o.native_cflags, o.qgemv_unroll, o.qgemv_unroll_glu, o.cupy_pdl) == (None, (), 2, 1, True)
    assert (o.cupy_prefill, o.cupy_prefill_graph, o.cupy_decoder, o.attn_chunk, o.attn_warps) == (
        "auto",
        None,
        "graph",
        32,
        0,
    )
    assert o.cupy_device_loop is True and o.cupy_mmq is True and o.cupy_mmq_split is True
    assert o.cupy_mmq_tokens == 128 and o.cupy_mmq_i8 is False and o.qgemv_min_blocks == 0
    assert o.attn_cluster == 8 and o.qgemv_row_budget == 0
    with pytest.raises(FrozenInstanceError):
        o.threads = 3  # type: ignore[misc]


def test_every_option_and_variable_is_documented() -> None:
    """Every `EngineOptions` field and every variable `from_env` reads has a row in the module's
    table and in docs/engine.md (an option added without its documentation fails here)."""
    import dataclasses

    import engine.options

    src = (ENGINE / "options.py").read_text(encoding="utf-8")
    rows = {
        "engine/options.py": engine.options.__doc__ or "",
        "docs/engine.md": (ENGINE.parent / "docs" / "engine.md").read_text(encoding="utf-8"),
    }
    names = [f"`{f.name}`" for f in dataclasses.fields(EngineOptions)]
    variables = sorted(set(re.findall(r'env\.get\("(GENIE_\w+)"', src)))
    assert len(variables) >= len(names) - 2  # threads and prefill_chunk read two / none
    for where, text in rows.items():
        table = "\n".join(line for line in text.splitlines() if line.startswith("| `"))
        missing = [n for n in names if n not in table] + [v for v in variables if v not in table]
        assert not missing, (where, missing)


def test_from_env_parses_every_variable() -> None:
    """Each variable sets its field with the parsing the engine always used."""
    env = {
        "GENIE_THREADS": "3",
        "OMP_NUM_THREADS": "7",
        "GENIE_NATIVE_CFLAGS": " -DA=1  -fno-x ",
        "GENIE_QGEMV_UNROLL": "4",
        "GENIE_QGEMV_UNROLL_GLU": "2",
        "GENIE_QGEMV_MIN_BLOCKS": "6",
        "GENIE_QGEMV_ROW_BUDGET": "4",
        "GENIE_CUPY_PDL": "0",
        "GENIE_CUPY_PREFILL": "float16",
        "GENIE_CUPY_PREFILL_GRAPH": "1",
        "GENIE_CUPY_DECODER": "eager",
        "GENIE_CUPY_DEVICE_LOOP": "0",
        "GENIE_CUPY_MMQ": "0",
        "GENIE_CUPY_MMQ_SPLIT": "0",
        "GENIE_CUPY_MMQ_TOKENS": "256",
        "GENIE_CUPY_MMQ_I8": "1",
        "GENIE_CUPY_ATTN_CHUNK": "64",
        "GENIE_CUPY_ATTN_WARPS": "8",
        "GENIE_CUPY_ATTN_CLUSTER": "0",
    }
    assert EngineOptions.from_env(env) == EngineOptions(
        threads=3,
        native_cflags=("-DA=1", "-fno-x"),
        qgemv_unroll=4,
        qgemv_unroll_glu=2,
        qgemv_min_blocks=6,
        qgemv_row_budget=4,
        cupy_pdl=False,
        cupy_prefill="float16",
        cupy_prefill_graph=True,
        cupy_decoder="eager",
        cupy_device_loop=False,
        cupy_mmq=False,
        cupy_mmq_split=False,
        cupy_mmq_tokens=256,
        cupy_mmq_i8=True,
        attn_chunk=64,
        attn_warps=8,
        attn_cluster=0,
    )


@pytest.mark.parametrize(
    "env,threads",
    [
        ({"OMP_NUM_THREADS": "5"}, 5),  # GENIE_THREADS unset: OpenMP's variable
        ({"GENIE_THREADS": "", "OMP_NUM_THREADS": "5"}, 5),
        ({"GENIE_THREADS": "2", "OMP_NUM_THREADS": "5"}, 2),
        ({"GENIE_THREADS": "0"}, None),  # not a thread count: every core
        ({"GENIE_THREADS": "many", "OMP_NUM_THREADS": "5"}, None),
    ],
)
def test_threads_come_from_genie_threads_else_omp_num_threads(env: dict[str, str], threads: int | None) -> None:
    """GENIE_THREADS wins when set; a value that is not a positive count means every core."""
    assert EngineOptions.from_env(env).threads == threads


@pytest.mark.parametrize("value,forced", [("0", False), ("1", True), ("", None), ("yes", None)])
def test_prefill_graph_is_forced_only_by_0_and_1(value: str, forced: bool | None) -> None:
    """GENIE_CUPY_PREFILL_GRAPH: 0 never, 1 always, anything else by model size."""
    assert EngineOptions.from_env({"GENIE_CUPY_PREFILL_GRAPH": value}).cupy_prefill_graph is forced


def test_pdl_is_off_only_for_0() -> None:
    """GENIE_CUPY_PDL switches programmatic dependent launch off with 0 and only with 0."""
    assert [EngineOptions.from_env({"GENIE_CUPY_PDL": v}).cupy_pdl for v in ("0", "1", "", "no")] == [
        False,
        True,
        True,
        True,
    ]


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an argument the process environment is read, at call time."""
    monkeypatch.setenv("GENIE_CUPY_ATTN_CHUNK", "48")
    assert EngineOptions.from_env().attn_chunk == 48


def test_numpy_model_keeps_the_options_it_was_loaded_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model uses the given options as they are, and reads the environment only without them."""
    monkeypatch.setenv("GENIE_CUPY_DECODER", "off")
    opts = EngineOptions(attn_chunk=16)
    assert load_model(_model(tmp_path), backend="numpy", n_ctx=64, options=opts).options is opts
    m = load_model(_model(tmp_path), backend="numpy", n_ctx=64)
    assert m.options == EngineOptions(cupy_decoder="off")


@pytest.mark.skipif(not native_available()[0], reason="native kernels unavailable")
def test_options_reach_the_native_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native backend runs the options' thread count and builds with their compiler flags; an
    explicit `threads=` wins; without options GENIE_THREADS still applies."""
    p = _model(tmp_path)
    flag = "-DGENIE_OPTIONS_TEST=1"
    m = load_model(p, backend="native", n_ctx=64, options=EngineOptions(threads=1, native_cflags=(flag,)))
    assert m.transformer.ops.threads == 1
    assert flag in m.transformer.ops.build_info
    plain = load_model(p, backend="native", n_ctx=64, options=EngineOptions(threads=1))
    assert flag not in plain.transformer.ops.build_info  # a library per flag set: no wrong reuse
    assert (
        load_model(p, backend="native", n_ctx=64, threads=2, options=EngineOptions(threads=1)).transformer.ops.threads
        == 2
    )
    monkeypatch.setenv("GENIE_THREADS", "3")
    assert load_model(p, backend="native", n_ctx=64).transformer.ops.threads == 3


def test_cupy_memory_plan_follows_the_prefill_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU plan counts first-chunk graphs, tile precision and the tile-free mmq GEMMs as the
    options say (the environment's when none are given, as load_model)."""
    gf = read_gguf(_model(tmp_path))
    spec = read_spec(gf)

    def graphs(**kw: object) -> int:
        return dict(plan_memory(gf, spec, 512, "f16", backend="cupy", **kw).parts)["prefill_graphs"]  # type: ignore[arg-type]

    assert graphs(options=EngineOptions()) > 0  # a small model: graphs by size
    assert graphs(options=EngineOptions(cupy_prefill_graph=False)) == 0
    monkeypatch.setenv("GENIE_CUPY_PREFILL_GRAPH", "0")
    assert graphs() == 0
    f32 = plan_memory(gf, spec, 512, "f16", backend="cupy", options=EngineOptions(cupy_prefill="float32"))
    opts = EngineOptions(cupy_prefill="float16", cupy_mmq=False)
    f16 = plan_memory(gf, spec, 512, "f16", backend="cupy", options=opts)
    assert dict(f32.parts)["prefill_tiles"] == 2 * dict(f16.parts)["prefill_tiles"] > 0
    opts = EngineOptions(cupy_prefill="float16", prefill_chunk=128)
    short = plan_memory(gf, spec, 512, "f16", backend="cupy", options=opts)
    assert dict(short.parts)["prefill_tiles"] == 0  # chunks <= cupy_mmq_tokens: mmq_h_<T> only, no tile
    mmq = plan_memory(gf, spec, 512, "f16", backend="cupy", options=EngineOptions(cupy_prefill="float16"))
    assert dict(mmq.parts)["prefill_tiles"] == dict(f16.parts)["prefill_tiles"]  # 512 > 128: tiles
    opts = EngineOptions(cupy_prefill="float16", cupy_mmq_tokens=512)
    assert dict(plan_memory(gf, spec, 512, "f16", backend="cupy", options=opts).parts)["prefill_tiles"] == 0
    opts = EngineOptions(cupy_prefill="float16", cupy_mmq_split=False)
    whole = plan_memory(gf, spec, 512, "f16", backend="cupy", options=opts)
    assert whole.total == f16.total
    assert mmq.total > whole.total  # the split GEMMs' slices of a short chunk (this shape's peak)
    with pytest.raises(ValueError, match="prefill_dtype"):
        plan_memory(gf, spec, 512, "f16", backend="cupy", options=EngineOptions(cupy_prefill="bf16"))


def test_kernel_sources_follow_the_options() -> None:
    """The decode module's source carries the unrolling and attention options, so modules cached by
    source never serve a model built with other options; the defaults give the old source."""
    shape = dict(n_heads=4, n_kv_heads=2, head_dim=64, v_head_dim=64, rope_half=32, neox=False, kv_half=True, n_split=8)
    base = decode_src.source(["Q4_K"], **shape)  # type: ignore[arg-type]
    assert "#define QGEMV_U 2\n#define QGEMV_UG 1\n" in base
    assert qdot_src.source(["Q4_K"]).startswith("#define QGEMV_U 2\n#define QGEMV_UG 1\n")
    other = decode_src.source(["Q4_K"], **shape, qgemv_unroll=4, qgemv_unroll_glu=2)  # type: ignore[arg-type]
    assert "#define QGEMV_U 4\n#define QGEMV_UG 2\n" in other and other != base
    assert decode_src.source(["Q4_K"], **shape, min_chunk=64) != base  # type: ignore[arg-type]


def test_no_engine_module_reads_the_environment_but_from_env() -> None:
    """Only EngineOptions.from_env reads engine variables; cpu_native reads CC, XDG_CACHE_HOME and
    GENIE_KERNEL_CACHE_DIR, strings_cache GENIE_STRINGS_CACHE_DIR (compiler and cache discovery,
    not tuning)."""
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not re.search(r"os\.environ|os\.getenv|getenv\(", line):
                continue
            rel = path.relative_to(ENGINE).as_posix()
            if (
                rel == "options.py"
                or (
                    rel == "backends/cpu_native.py"
                    and re.search(r"\"(CC|XDG_CACHE_HOME|GENIE_KERNEL_CACHE_DIR)\"", line)
                )
                or (rel == "strings_cache.py" and '"GENIE_STRINGS_CACHE_DIR"' in line)
            ):
                continue
            offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []


def test_tile_width_follows_the_chunk_and_the_grid() -> None:
    """`mmq_tile` takes 128-token tiles only for chunks of 128+ tokens whose 64-token grid puts two
    to four blocks on each multiprocessor, and 64-token tiles otherwise."""
    assert mmq_tile(64, 20_000, 132) == 64  # a short chunk never pads to 128
    assert mmq_tile(512, 2_560, 132) == 128  # 8 x 20 blocks: two on each SM
    assert mmq_tile(512, 1_024, 132) == 64  # 8 x 8 blocks: fewer than the SMs
    assert mmq_tile(512, 19_456, 132) == 64  # 8 x 152 blocks: ten on each SM
    assert mmq_tile(1024, 4_096, 132) == 128  # 16 x 32 blocks: four on each SM
    assert mmq_tile(512, 1_024, 8) == 64  # 64 blocks on 8 SMs: eight each
    assert mmq_tile(256, 1_024, 8) == 128  # 32 blocks on 8 SMs: four each


def test_two_piece_gemvs_pair_the_types_that_round_alike() -> None:
    """The decode module gets a two-piece GEMV for each ordered pair of types whose inputs round
    alike (K-quants with K-quants, Q4_1 with Q8_0), and its plain K-quant GEMVs read 64-value
    chunks while the gate+up kernels keep 32-value ones."""
    from engine.kernels import qdot_src

    assert qdot_src.mix_pairs(["Q6_K", "Q4_K", "F16"]) == [("Q4_K", "Q6_K"), ("Q6_K", "Q4_K")]
    assert qdot_src.mix_pairs(["Q4_1", "Q8_0", "Q4_K"]) == [("Q4_1", "Q8_0"), ("Q8_0", "Q4_1")]
    assert qdot_src.mix_pairs(["Q4_K", "Q4_1"]) == []
    src = qdot_src.source(["Q4_K", "Q6_K"])
    kernels = {}  # kernel -> the chunk code of its (first) body
    for part in src.split('extern "C" __global__')[1:]:
        name = re.search(r"(qgemv\w+)\(", part)
        body = re.search(r"qgemv_body_(\w+)<", part)
        if name and body:
            kernels[name.group(1)] = body.group(1)
    assert kernels == {
        "qgemv_Q4_K": "Q4_K2",
        "qgemv_glu_Q4_K": "Q4_K",
        "qgemv_Q6_K": "Q6_K2",
        "qgemv_glu_Q6_K": "Q6_K",
        "qgemv_mix_Q4_K_Q6_K": "Q4_K2",
        "qgemv_mix_Q6_K_Q4_K": "Q6_K2",
    }
    assert "#define QCW_Q4_K2 6" in src and "#define QCW_Q6_K2 6" in src


def test_min_blocks_bounds_every_integer_gemv_and_only_when_asked() -> None:
    """`qgemv_min_blocks` N puts `__launch_bounds__(256, N)` on every integer GEMV kernel (plain,
    gate+up, two-piece); 0 keeps the built-in bounds (5 blocks for the 64-value K-quant kernels)."""
    from engine.kernels import qdot_src

    plain, held = qdot_src.source(["Q4_K", "Q6_K", "Q4_1", "Q8_0"]), qdot_src.source(["Q4_K", "Q4_1"], min_blocks=6)
    assert "#define QGEMV_MINB" not in plain and "#define QGEMV_MINB 6\n" in held
    for src in (plain, held):
        kernels = re.findall(r'extern "C" __global__ void (\w+) (qgemv\w+)\(', src)
        assert kernels and {b for b, _ in kernels} <= {"QLB_Q4_K2", "QLB_Q6_K2", "QLB_Q4_1", "QLB_Q8_0", "QLB_GLU"}
    held_defs = held[held.index("#ifdef QGEMV_MINB") : held.index("#else", held.index("#ifdef QGEMV_MINB"))]
    for name in ("QLB_Q4_1", "QLB_Q8_0", "QLB_KQ2", "QLB_GLU"):
        assert f"#define {name} __launch_bounds__(256, QGEMV_MINB)" in held_defs


def test_short_chunks_split_k_only_where_the_grid_leaves_the_gpu_idle() -> None:
    """`mmq_splits` splits K for chunks of <= 128 tokens whose grid gives fewer than two blocks
    an SM (as many splits as fill it, within the slice and K-step bounds), never otherwise, and
    its slices never hold more than the MMQ_SPLIT_ROWS values a token that the plan counts."""
    assert mmq_splits(72, 2_560, 9_728, 132) == 6  # a 4B ffn_down for a question: 40 -> 240 blocks
    assert mmq_splits(72, 6_144, 2_560, 132) == 2  # QKV: 96 blocks; 16,384 / 6,144 slices at most
    assert mmq_splits(72, 19_456, 2_560, 132) == 1  # gate+up: 304 blocks fill it already
    assert mmq_splits(200, 2_560, 9_728, 132) == 1  # a longer chunk: never
    assert mmq_splits(72, 2_560, 9_728, 8) == 1  # an Orin's 8 SMs: 40 blocks are plenty
    assert mmq_splits(16, 576, 256, 132) == 1  # four K steps: no split leaves a block one step
    assert mmq_splits(16, 576, 1_536, 132) == 6  # a SmolLM2 ffn_down: 24 steps, 6 splits of 4
    for t in (2, 16, 72, 128):
        for rows in (64, 576, 1_000, 2_560, 5_120, 6_144, 8_192, 9_000, 19_456):
            for sms in (8, 16, 132):
                for bn in (64, 128):
                    s = mmq_splits(t, rows, 9_728, sms, bn)
                    assert s == 1 or (2 <= s <= 8 and s * rows <= MMQ_SPLIT_ROWS), (t, rows, sms, bn, s)
