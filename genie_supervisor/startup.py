"""The daemon's warm start: where compiled kernels are kept, the engine's per-process work done
ahead, and how long the process took from its start to ready.

`prepare(cfg)` runs first in ``genie-supervisor run``, before the daemon's heavy imports: it points
the kernel caches at ``engine.kernel_cache_dir`` (``CUPY_CACHE_DIR`` for CuPy's NVRTC output,
``GENIE_KERNEL_CACHE_DIR`` for the native CPU kernels) and starts `engine.prewarm` in a thread
when the builtin backend serves a model. `since_process_start()` is the start-to-ready clock
(process creation as the kernel records it, so the interpreter's own start counts too).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from engine.prewarm import Prewarm

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
    """Point CuPy's and the native kernels' caches into `folder` (a variable already set in the
    environment wins); returns the variables it set."""
    wanted = {"CUPY_CACHE_DIR": str(folder / "cupy"), "GENIE_KERNEL_CACHE_DIR": str(folder / "native")}
    done = {k: v for k, v in wanted.items() if not environ.get(k)}
    environ.update(done)
    return done


def prepare(cfg: Config) -> Path:
    """Kernel caches, then the engine's per-process work in a thread when a builtin model is
    configured (before the daemon's imports, so the two overlap); returns the kernel folder."""
    global PREWARM, KERNELS
    folder = KERNELS = kernel_cache_dir(cfg.engine.kernel_cache_dir)
    use_kernel_cache(folder)
    builtin = [e for e in cfg.model_entries().values() if (e.backend or cfg.backend) == "builtin" and e.path]
    if builtin and cfg.engine.prewarm:
        from engine.prewarm import start_prewarm

        PREWARM = start_prewarm(cfg.engine.backend)
    return folder


def startup_status(models: ModelManager) -> dict[str, Any]:
    """The start's timing for /status and the ``supervisor_ready`` line: process start to ready
    (the resident models loaded), each model's load, the prewarm thread."""
    pre = PREWARM
    done = pre is not None and pre.done.is_set()
    return {
        "start_to_ready_s": models.ready_s,
        "load_s": {m.id: None if m.load_seconds is None else round(m.load_seconds, 3) for m in models.models.values()},
        "prewarm_s": round(pre.seconds, 3) if done and pre is not None and pre.seconds is not None else None,
        "prewarm_error": pre.error if done and pre is not None else None,
        "kernel_cache_dir": str(KERNELS) if KERNELS is not None else None,
    }
