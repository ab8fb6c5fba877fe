"""Every CUDA source the CuPy backend builds compiles with NVRTC and has no template placeholder
left, for each synth preset's shape, KV cache type and GPU (sm_87: Jetson Orin, sm_90: H100/H200).

No GPU is needed: NVRTC is a compiler library (the `nvidia-cuda-nvrtc-cu12` wheel of the `dev`
extra, a CUDA install's libnvrtc, or CuPy's). Skipped where none can be loaded. Each source is
compiled to a cubin for the GPU with the backend's options, so a kernel typo, a wrong inline PTX
instruction (ptxas) or a placeholder that no generator fills fails here, not on a device. Every
specialisation is compiled with `-G` (no device optimisation: ~7x faster, and no dead code is
dropped before it is checked); the fixed modules and the most used decode module also exactly as
the backend builds them.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from bench.sass_loops import nvrtc_libraries
from engine import kernels
from engine.kernels import decode_src, ops_src, qdot_src, quant_units, sample_src
from engine.options import DEFAULT_OPTIONS
from engine.spec import ARCHITECTURES
from engine.synth import PRESETS, preset_config

pytestmark = pytest.mark.timeout(300)

OPTIONS = ("--std=c++17",)
"""The options the backend gives NVRTC (`kernels.module`, `cupy_decoder._module`, `cupy_sample._module`)."""
SM_COUNTS = {"sm_87": (8, 16), "sm_90": (132,)}
"""Multiprocessors of the GPUs of each architecture (Orin Nano / AGX Orin; H100 and H200 SXM): the
decode module's attention split follows them (`CupyDecoder.n_split`)."""
KV_TYPES = ("float32", "float16", "int8")
"""The KV cache element types the decode module is built for."""
PLACEHOLDER = re.compile(r"\{[A-Z][A-Z0-9_]*\}|%\(\w+\)[a-z]|\$\{?[A-Za-z_]\w*\}?|@[A-Za-z_]\w*@")
"""What an unfilled template field looks like: `{NAME}` (str.replace), `%(name)s` (% formatting),
`$NAME` / `${NAME}` and `@NAME@`."""

Compiler = Callable[[str, str, tuple[str, ...]], tuple[bool, str]]
"""(CUDA C, sm_XX, extra options) -> (compiled, NVRTC's log)."""


def _ctypes_compiler(lib: ctypes.CDLL) -> Compiler:
    """A compiler calling libnvrtc's C API through ctypes."""
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(rc).decode()}")

    def compile_(src: str, arch: str, extra: tuple[str, ...]) -> tuple[bool, str]:
        prog = ctypes.c_void_p()
        check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"genie.cu", 0, None, None))
        try:
            opts = [o.encode() for o in (*OPTIONS, f"--gpu-architecture={arch}", *extra)]
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            size = ctypes.c_size_t()
            check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)))
            log = ctypes.create_string_buffer(size.value)
            check(lib.nvrtcGetProgramLog(prog, log))
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == 0, log.value.decode(errors="replace")

    return compile_


def _cupy_compiler() -> Compiler:
    """A compiler through CuPy's NVRTC bindings."""
    from cupy.cuda import nvrtc

    def compile_(src: str, arch: str, extra: tuple[str, ...]) -> tuple[bool, str]:
        prog = nvrtc.createProgram(src, "genie.cu", (), ())
        try:
            try:
                nvrtc.compileProgram(prog, [*OPTIONS, f"--gpu-architecture={arch}", *extra])
                ok = True
            except nvrtc.NVRTCError:
                ok = False
            return ok, nvrtc.getProgramLog(prog)
        finally:
            nvrtc.destroyProgram(prog)

    return compile_


def _compiler() -> tuple[Compiler | None, str]:
    """The first NVRTC that loads, and why there is none otherwise."""
    for name in nvrtc_libraries():
        try:
            return _ctypes_compiler(ctypes.CDLL(name)), name
        except OSError:
            continue
    try:
        return _cupy_compiler(), "cupy.cuda.nvrtc"
    except Exception as e:  # noqa: BLE001 - no CuPy, or a CuPy without its CUDA libraries
        return None, f"no libnvrtc (pip install nvidia-cuda-nvrtc-cu12) and no CuPy NVRTC: {e}"


COMPILE, WHERE = _compiler()


def decode_sources(sm_counts: tuple[int, ...], cluster: int = 0) -> dict[str, str]:
    """The decode module of every synth preset x KV cache type x attention split (as
    `CupyDecoder.__init__` builds it, with `cluster` blocks a KV head's attention cluster), by a
    readable key."""
    out = {}
    for name in sorted(PRESETS):
        c = preset_config(name)
        hd = c.head_dim or c.n_embd // c.n_heads
        types = sorted({c.weight_type, *c.type_overrides.values()})
        neox = ARCHITECTURES[c.arch].rope_style == "neox"
        for kv in KV_TYPES:
            for n_sm in sm_counts:
                n_split = decode_src.attn_split(n_sm, c.n_kv_heads)
                shape: dict[str, Any] = {
                    "n_heads": c.n_heads,
                    "n_kv_heads": c.n_kv_heads,
                    "head_dim": hd,
                    "v_head_dim": hd,
                    "rope_half": hd // 2,
                    "neox": neox,
                    "kv_half": kv == "float16",
                    "kv_int8": kv == "int8",
                    "n_split": n_split,
                    "min_chunk": 32,
                }
                out[f"decode[{name},{kv},split={n_split},cluster={cluster}]"] = decode_src.source(
                    types,
                    **shape,
                    warps=decode_src.attn_warps(c.n_heads // c.n_kv_heads, hd, cluster),
                    attn_cluster=cluster,
                )
                if cluster:  # the plain attention a clustered decoder runs past one cluster (plan_long)
                    out[f"decode-long[{name},{kv},split={n_split}]"] = decode_src.source(
                        types, **shape, warps=decode_src.attn_warps(c.n_heads // c.n_kv_heads, hd), attention_only=True
                    )
    return out


def sources(arch: str) -> dict[str, str]:
    """Every translation unit the backend compiles on a GPU of `arch`, by a readable key."""
    every_type = sorted(quant_units.TYPES)
    out = {"kernels": kernels.full_source(), "sample": sample_src.source(), "mmq": kernels.mmq_source()}
    out |= decode_sources(SM_COUNTS[arch], DEFAULT_OPTIONS.attn_cluster if arch == "sm_90" else 0)
    # every weight type at once (the real models mix more types than the presets: Q5_0, Q8_0, F16, ...)
    shape: dict[str, Any] = {
        "n_heads": 8,
        "n_kv_heads": 2,
        "head_dim": 64,
        "v_head_dim": 64,
        "rope_half": 32,
        "neox": True,
        "kv_half": True,
        "n_split": 16,
        "min_chunk": 32,
        "warps": decode_src.attn_warps(4, 64),
    }
    out["decode[every type]"] = decode_src.source(every_type, **shape)
    # the GEMVs held to more blocks an SM (EngineOptions.qgemv_min_blocks, a tuning option)
    out["decode[every type, min_blocks=6]"] = decode_src.source(every_type, **shape, qgemv_min_blocks=6)
    return out


def placeholders(src: str) -> list[str]:
    """The unfilled template fields of `src` (each once, in order)."""
    return list(dict.fromkeys(PLACEHOLDER.findall(src)))


def test_the_placeholder_check_sees_each_generators_fields() -> None:
    """The raw templates of every generator have fields the check finds (so a left-over one fails)."""
    for template in (
        decode_src.SHAPED,
        decode_src.GEMV,
        qdot_src.QGEMV,
        ops_src.ATTN,
        quant_units.PER_TYPE,
        sample_src.SOURCE,
    ):
        assert placeholders(template)
    assert placeholders("int a = {NSPLIT}; float b = %(CHUNK)d; x = $N; y = @T@;") == [
        "{NSPLIT}",
        "%(CHUNK)d",
        "$N",
        "@T@",
    ]


@pytest.mark.parametrize("arch", sorted(SM_COUNTS))
def test_no_template_placeholder_is_left(arch: str) -> None:
    """No generated source keeps an unfilled template field."""
    left = {key: found for key, src in sources(arch).items() if (found := placeholders(src))}
    assert not left


def compile_all(todo: dict[str, str], arch: str, extra: tuple[str, ...]) -> tuple[int, dict[str, object]]:
    """Compile `todo` for `arch` (a few at once) and return how many and the failures' error lines."""
    assert COMPILE is not None
    compile_ = COMPILE
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = dict(zip(todo, pool.map(lambda src: compile_(src, arch, extra), todo.values()), strict=True))
    return len(todo), {
        key: [line for line in log.splitlines() if "error" in line][:5] or log[-2000:]
        for key, (ok, log) in results.items()
        if not ok
    }


needs_nvrtc = pytest.mark.skipif(COMPILE is None, reason=f"NVRTC unavailable: {WHERE}")


@needs_nvrtc
@pytest.mark.parametrize("arch", sorted(SM_COUNTS))
def test_every_generated_source_compiles(arch: str) -> None:
    """NVRTC compiles every source the backend generates for `arch` (`-G`: every line is checked)."""
    n, failed = compile_all(sources(arch), arch, ("-G",))
    assert not failed, f"{len(failed)} of {n} sources do not compile for {arch} ({WHERE})"


@needs_nvrtc
@pytest.mark.parametrize("arch", sorted(SM_COUNTS))
def test_the_backend_build_compiles(arch: str) -> None:
    """The elementwise kernels, the prefill GEMMs (fp16 and int8), the sampler and the Qwen3-4B-shape
    decode module (fp16 KV cache) compile with exactly the backend's options (device optimisation on)."""
    every = sources(arch)
    todo = {
        k: v
        for k, v in every.items()
        if k in ("kernels", "sample", "mmq") or k.startswith("decode[qwen3-4b-q4_k_m,float16,")
    }
    assert len(todo) == 3 + len(SM_COUNTS[arch])
    n, failed = compile_all(todo, arch, ())
    assert not failed, f"{len(failed)} of {n} sources do not compile for {arch} ({WHERE})"


def test_attention_clusters_only_where_asked() -> None:
    """The decode module holds cluster code only when built with clusters; a cluster build takes 8 warps
    up to 512 query values a KV head (else the slices' rule) and whole clusters of `n_split`'s blocks."""
    shape: dict[str, Any] = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128, "v_head_dim": 128, "rope_half": 64}
    plain = decode_src.source(["Q4_K"], **shape, neox=True, kv_half=True, n_split=33)
    clustered = decode_src.source(["Q4_K"], **shape, neox=True, kv_half=True, n_split=33, attn_cluster=8)
    assert "#define ATT_CLUSTER 0\n" in plain and "#define NW 4 " in plain
    assert "#define ATT_CLUSTER 8\n" in clustered and "#define NW 8 " in clustered
    assert decode_src.attn_warps(4, 128) == 4 and decode_src.attn_warps(4, 128, 8) == 8
    assert decode_src.attn_warps(8, 128, 8) == 4 and decode_src.attn_warps(3, 64, 8) == 8
    assert [decode_src.attn_blocks(n, 8) for n in (33, 64, 8)] == [32, 64, 8]
    assert decode_src.attn_blocks(33, 0) == 33
    with pytest.raises(ValueError, match="does not fit"):
        decode_src.attn_blocks(5, 8)
