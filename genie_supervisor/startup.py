"""The daemon's warm start: where compiled kernels are kept, the engine's per-process work done
ahead, and how long the process took from its start to ready.

`boot.start` runs first in ``genie-supervisor run``, before even the config's validation, and
starts the prewarm thread with the start model's load from the raw files; `prepare(cfg)` runs
next, before the daemon's heavy imports: it checks that early load against the validated config
(or, when `boot` started nothing, starts the prewarm itself); it points
the kernel caches at ``engine.kernel_cache_dir`` (``CUPY_CACHE_DIR`` for CuPy's NVRTC output,
``GENIE_KERNEL_CACHE_DIR`` for the native CPU kernels) and starts `engine.prewarm` in a thread
when the builtin backend serves a model. `since_process_start()` is the start-to-ready clock
(process creation as the kernel records it, so the interpreter's own start counts too).
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from engine.gguf_file import GGUFFile
    from engine.options import EngineOptions
    from engine.prewarm import EarlyLoad, Prewarm

    from .config import Config
    from .llm.manager import ModelManager

PREWARM: Prewarm | None = None
"""The prewarm thread's record once `prepare` started one (read by the startup log line)."""
KERNELS: Path | None = None
"""The kernel cache folder `prepare` chose (None: `prepare` did not run, e.g. a daemon in tests)."""


def process_age() -> float:
    """Seconds since the kernel created this process: Linux's start time in clock ticks since boot
    (/proc/self/stat, 10 ms steps) against CLOCK_BOOTTIME; elsewhere psutil's wall-clock start
    (whose boot time is whole seconds on Linux, hence not used there)."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime); the split drops pid and comm
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        try:
            return time.time() - float(psutil.Process().create_time())
        except psutil.Error:  # pragma: no cover - no /proc at all
            return 0.0


_STARTED = time.monotonic() - process_age()


def since_process_start() -> float:
    """Seconds since this process was created, rounded to milliseconds."""
    return round(time.monotonic() - _STARTED, 3)


def kernel_cache_dir(configured: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where compiled kernels are kept: `configured` (``engine.kernel_cache_dir``), else
    ``$CACHE_DIRECTORY/kernels`` (systemd's ``CacheDirectory=``, /var/cache/genie-supervisor),
    else ``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/genie-supervisor/kernels``."""
    if configured:
        return Path(configured)
    systemd = environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if systemd:
        return Path(systemd) / "kernels"
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "genie-supervisor" / "kernels"


def use_kernel_cache(folder: Path, environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """Point CuPy's and the native kernels' caches and the GGUF strings cache
    (`engine.strings_cache`) into `folder` (a variable already set in the environment wins);
    returns the variables it set."""
    wanted = {
        "CUPY_CACHE_DIR": str(folder / "cupy"),
        "GENIE_KERNEL_CACHE_DIR": str(folder / "native"),
        "GENIE_STRINGS_CACHE_DIR": str(folder / "strings"),
    }
    done = {k: v for k, v in wanted.items() if not environ.get(k)}
    environ.update(done)
    return done


def prepare(cfg: Config) -> Path:
    """Kernel caches, then the engine's per-process work in a thread when a builtin model is
    configured (before the daemon's imports, so the two overlap), and, when exactly one model
    loads at the start, that model's load too if its plan fits the policy's budget (the model
    manager then takes it instead of loading: `take_early`); returns the kernel folder."""
    global PREWARM, KERNELS
    folder = KERNELS = kernel_cache_dir(cfg.engine.kernel_cache_dir)
    use_kernel_cache(folder)
    builtin = [e for e in cfg.model_entries().values() if (e.backend or cfg.backend) == "builtin" and e.path]
    from . import boot

    booted = boot.record()
    if booted is not None:  # `boot.start` began with the raw files: the same load, or none
        PREWARM = booted
        early, options = _early(cfg) if builtin and cfg.engine.prewarm else (None, None)
        if (early, options, cfg.engine.backend) != (booted.early, booted.options, booted.backend_asked):
            booted.disown("the validated config or policy asks for another load")
    elif builtin and cfg.engine.prewarm:
        from engine.prewarm import start_prewarm

        early, options = _early(cfg)
        PREWARM = start_prewarm(cfg.engine.backend, options, early)
    return folder


def _early(cfg: Config) -> tuple[EarlyLoad | None, EngineOptions | None]:
    """The one model that loads at the start, with the policy's budget and prefill chunk (None
    when several or none load at the start, or the policy cannot be read: the daemon says why)."""
    from engine.options import EngineOptions
    from engine.prewarm import EarlyLoad

    from .errors import PolicyErrors
    from .policy import load_policy
    from .policy.schema import builtin_policy

    entries = cfg.model_entries()
    groups: set[str] = set()
    start = []
    for e in entries.values():
        if e.resident or (e.preload and (e.group is None or e.group not in groups)):
            start.append(e)
            if e.group is not None:
                groups.add(e.group)
    if len(start) != 1 or (start[0].backend or cfg.backend) != "builtin" or not start[0].path:
        return None, None
    try:
        policy = load_policy(cfg.policy.path) if cfg.policy.path else builtin_policy()
    except PolicyErrors:
        return None, None
    e = start[0]
    options = replace(EngineOptions.from_env(), prefill_chunk=policy.voice.prefill_chunk_tokens)
    early = EarlyLoad(
        path=os.fspath(e.path or ""),
        n_ctx=e.n_ctx or cfg.engine.n_ctx,
        kv_dtype=e.kv_dtype or cfg.engine.kv_dtype,
        threads=cfg.engine.threads,
        budget_bytes=int(policy.memory.llm_budget_mb * 1024 * 1024),
    )
    return early, options


def take_early(backend: str, options: EngineOptions, path: str, n_ctx: int, kv: str, threads: int | None) -> Any:
    """The model loaded early for a load of exactly these parameters (once), else None."""
    pre = PREWARM
    return None if pre is None else pre.take(backend, options, path, n_ctx, kv, threads)


def early_header(path: str) -> GGUFFile | None:
    """The GGUF header the early load read of `path` (once; None: none, another file, or changed
    since), so that the daemon's plan at start does not parse a 150k-token vocabulary again."""
    pre = PREWARM
    return None if pre is None or pre.disowned is not None else pre.header(path)


def release_early() -> None:
    """Drop an early-loaded model nobody took (its memory goes back)."""
    if PREWARM is not None:
        PREWARM.model = None


def startup_status(models: ModelManager) -> dict[str, Any]:
    """The start's timing for /status and the ``supervisor_ready`` line: process start to ready
    (the resident models loaded), each model's load, the prewarm thread, and the objects the
    start left frozen out of the garbage collector's walks (`gc_start`: 0 when it was not held)."""
    pre = PREWARM
    done = pre is not None and pre.done.is_set()
    return {
        "start_to_ready_s": models.ready_s,
        "load_s": {m.id: None if m.load_seconds is None else round(m.load_seconds, 3) for m in models.models.values()},
        "prewarm_s": round(pre.seconds, 3) if done and pre is not None and pre.seconds is not None else None,
        "prewarm_error": pre.error if done and pre is not None else None,
        "cuda_context_s": round(pre.context_s, 3) if done and pre is not None and pre.context_s is not None else None,
        "early_load_s": round(pre.load_s, 3) if done and pre is not None and pre.load_s is not None else None,
        "early_skipped": pre.skipped if done and pre is not None else None,
        "kernel_cache_dir": str(KERNELS) if KERNELS is not None else None,
        "gc_frozen": gc.get_freeze_count(),
    }
