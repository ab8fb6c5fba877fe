"""Native CPU backend: quantized GEMV in C over the GGUF blocks (`engine/kernels/cpu/qgemv.c`).

The C source is compiled at first use with the system C compiler into a cache directory outside
the repository (``~/.cache/genie-supervisor/kernels/<hash>.so``; the hash covers the source, the
compiler, the flags and the machine) and loaded with ctypes. Weight matrices stay in their GGUF
block layout (no float32 copy); every projection quantizes its activation row once, the way
llama.cpp's x86 CPU backend does (Q8_0 / Q8_1 / Q8_K), and computes integer block dot products
with the float accumulation of its AVX2 build. RMSNorm, RoPE, attention over the fp16 cache and
the gated activations are C too, with llama.cpp's arithmetic (docs/engine.md): for Q4_1/Q8_0
models such as SmolLM2 the logits are llama.cpp's bit for bit. The rest (embedding lookup,
residual adds, other caches' attention) is NumPy: `NativeOps` hands it to the `NumpyOps` it holds.
This module builds and loads the kernels; `NativeOps` (in `cpu_native_ops`) calls them.

Without a working compiler `native_available()` returns ``(False, reason)`` and `auto` falls
back to the NumPy backend. A cache folder that cannot be written (read-only, not a directory, disk
full) is a warning, not a failure: the kernels are compiled into a temporary folder for this
process and loaded from there.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..gguf_file import GGML_TYPES
from ..options import DEFAULT_OPTIONS, EngineOptions

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "cpu" / "qgemv.c"

ACT_KIND = {"Q4_0": 0, "Q5_0": 0, "Q8_0": 0, "Q4_1": 0, "Q5_1": 0, "Q4_K": 1, "Q5_K": 1, "Q6_K": 1}
"""Activation blocks per weight type: 0 = 32 (Q8_0, with Q8_1's sum term), 1 = 256 (Q8_K)."""
GGML_TYPE = {name: i for i, (name, _, _) in GGML_TYPES.items() if name in ACT_KIND}
"""ggml type ids of the block types the kernel handles (`gguf_file.GGML_TYPES`)."""

_lock = threading.Lock()
_state: dict[str, Any] = {}
_libs: dict[tuple[str, ...], tuple[ctypes.CDLL | None, str]] = {}
"""Built libraries by their extra compiler flags (`EngineOptions.native_cflags`)."""


def cache_dir() -> Path:
    """$GENIE_KERNEL_CACHE_DIR (the daemon sets it from engine.kernel_cache_dir), else
    $XDG_CACHE_HOME (or ~/.cache) /genie-supervisor/kernels."""
    if os.environ.get("GENIE_KERNEL_CACHE_DIR"):
        return Path(os.environ["GENIE_KERNEL_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "genie-supervisor" / "kernels"


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _flag_sets(extra: tuple[str, ...] = ()) -> list[list[str]]:
    """The flag sets tried in turn, best first, each with the `extra` flags (experiments)."""
    arch = ["-mcpu=native"] if platform.machine().lower() in ("aarch64", "arm64") else ["-march=native"]
    base = ["-O3", "-std=gnu99", "-ffp-contract=off", "-shared", "-fPIC"]
    base += list(extra)
    return [base + arch + ["-fopenmp"], base + arch, base + ["-fopenmp"], base]


def build_library(flags: list[str]) -> tuple[ctypes.CDLL | None, str]:
    """Compile (or reuse from the cache) and load the kernels with exactly these flags."""
    cc = _compiler()
    if cc is None:
        return None, "no C compiler on PATH (cc, gcc, clang or $CC)"
    try:
        src = SOURCE.read_bytes()
    except OSError as exc:
        return None, f"kernel source missing: {exc}"
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{cc} does not run: {exc}"
    key = hashlib.sha256(
        b"\0".join(
            [
                src,
                cc.encode(),
                ver.encode(),
                " ".join(flags).encode(),
                platform.machine().encode(),
                platform.system().encode(),
            ]
        )
    ).hexdigest()[:20]
    out = cache_dir() / f"qgemv-{key}.so"
    scratch: str | None = None
    try:
        if not out.exists():
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
                os.close(fd)
            except OSError as exc:  # read-only, not a directory, disk full: build for this process only
                _warn_uncached(out.parent, exc)
                try:
                    scratch = tempfile.mkdtemp(prefix="genie-kernels-")
                except OSError as exc2:
                    return None, f"{' '.join(flags)}: no writable folder for the build: {exc}; {exc2}"
                tmp = os.path.join(scratch, out.name + ".part")
                out = Path(scratch) / out.name
            try:
                r = subprocess.run(
                    [cc, *flags, "-o", tmp, str(SOURCE), "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                if r.returncode != 0:
                    _unlink(tmp)
                    last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
                    return None, f"{' '.join(flags)}: {last}"
                os.replace(tmp, out)  # atomic: concurrent builders never load a partial file
            except (OSError, subprocess.SubprocessError) as exc:
                _unlink(tmp)
                return None, f"{' '.join(flags)}: {exc}"
        try:
            lib = ctypes.CDLL(str(out))
        except OSError as exc:
            return None, f"load {out}: {exc}"
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)  # once loaded, the mapping outlives the file
    _declare(lib)
    mode = lib.qg_init()
    where = " (not cached: the cache folder cannot be written)" if scratch is not None else ""
    return lib, f"{out.name} ({' '.join(flags)}; {'OpenMP' if mode == 2 else 'one thread'}){where}"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _warn_uncached(folder: Path, exc: OSError) -> None:
    """Say once per process that the kernel cache cannot be written (each start compiles again)."""
    if not _state.get("warned_uncached"):
        _state["warned_uncached"] = True
        logging.getLogger(__name__).warning(
            "native kernels: cache %s cannot be written (%s); compiling into a temporary folder "
            "for this process (every start compiles again)",
            folder,
            exc,
        )


def _build(extra: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    errors: list[str] = []
    for flags in _flag_sets(extra):
        lib, why = build_library(flags)
        if lib is not None:
            if errors:  # a fallback build: slower (and it says why the better one failed)
                why += " after: " + "; ".join(e[:300] for e in errors)
                logging.getLogger(__name__).warning("native kernels: fell back to %s", why)
            return lib, why
        errors.append(why)
        if why.startswith(("no C compiler", "kernel source missing")):
            break
    return None, "kernel build failed: " + "; ".join(errors)


def _declare(lib: ctypes.CDLL) -> None:
    vp, i, lg, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_size_t
    lib.qg_init.restype = i
    lib.qg_init.argtypes = []
    lib.qg_act_row_bytes.restype = sz
    lib.qg_act_row_bytes.argtypes = [i, i]
    lib.qg_act_kind.restype = i
    lib.qg_act_kind.argtypes = [i]
    lib.qg_quantize.restype = None
    lib.qg_quantize.argtypes = [i, vp, lg, i, i, vp, i]
    lib.qg_gemm.restype = i
    lib.qg_gemm.argtypes = [i, vp, i, i, vp, i, vp, lg, vp, i]
    lib.qg_max_threads.restype = i
    lib.qg_max_threads.argtypes = []
    lib.qg_f32_to_f16.restype = ctypes.c_uint16
    lib.qg_f32_to_f16.argtypes = [ctypes.c_float]
    f = ctypes.c_float
    lib.qg_rms_norm.restype = None
    lib.qg_rms_norm.argtypes = [vp, lg, vp, vp, i, i, f, i]
    lib.qg_rope_cache.restype = None
    lib.qg_rope_cache.argtypes = [i, i, i, f, f, vp, vp]
    lib.qg_rope.restype = None
    lib.qg_rope.argtypes = [vp, i, i, i, i, vp, vp, i, i]
    lib.qg_attn_f16.restype = i
    lib.qg_attn_f16.argtypes = [vp, i, i, i, vp, vp, i, i, i, i, i, f, vp, i]
    lib.qg_glu.restype = None
    lib.qg_glu.argtypes = [i, vp, vp, lg, vp, i, i, i]


def load_library(extra_cflags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel library with these extra compiler flags (built once per process and
    flags, cached on disk), or None and why."""
    key = tuple(extra_cflags)
    with _lock:
        if key not in _libs:
            _libs[key] = _build(key)
        return _libs[key]


def native_available(extra_cflags: tuple[str, ...] = ()) -> tuple[bool, str]:
    """Whether the native CPU kernels build and load here, and why not when they don't."""
    lib, why = load_library(extra_cflags)
    return lib is not None, why


def default_threads(options: EngineOptions | None = None) -> int:
    """The options' thread count (`EngineOptions.threads`), else every core."""
    return (options or DEFAULT_OPTIONS).threads or os.cpu_count() or 1


def limit_blas_threads(n: int) -> bool:
    """Set the OpenBLAS thread count of NumPy's BLAS (process-wide); False when not found.

    The kernels' OpenMP threads and OpenBLAS's own pool would otherwise spin against each other
    on a small machine (measured on 2 cores: decode 39 -> 85 tok/s with BLAS at one thread).
    """
    try:
        with open("/proc/self/maps") as fh:
            libs = {line.split()[-1] for line in fh if "openblas" in line.lower() and "/" in line}
    except OSError:
        return False
    done = False
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in (
            "scipy_openblas_set_num_threads64_",
            "scipy_openblas_set_num_threads",
            "openblas_set_num_threads64_",
            "openblas_set_num_threads",
        ):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                fn.restype = None
                fn(int(n))
                done = True
                break
    return done
