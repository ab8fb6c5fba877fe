"""The per-process start-up work of a backend, done ahead of the first model load.

A fresh process pays, before its first model is usable, for work that does not depend on the
model: importing CuPy, creating the CUDA context, and compiling (or reading from the kernel cache)
the CUDA kernels of the forward pass and the sampler; on the CPU, building (or loading from the
cache) the native kernels. A process that loads a second model pays none of it again, which is
why a benchmark loading a model after another measures a fraction of a daemon's cold start.

`prewarm(backend)` does that work; the daemon runs it in a thread at process start
(`start_prewarm`), so it overlaps with the daemon's own imports and start-up, which spend most of
their time holding the GIL while the CUDA driver calls here release it. `engine.load_model` later
finds the context made and the modules loaded (both are per process).

    thread = start_prewarm("auto")     # returns at once
    ...                                # imports, config, HTTP server
    model = load_model(path)           # the context and kernels are there
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .options import EngineOptions


@dataclass
class Prewarm:
    """What `prewarm` did (filled in by the thread; read once it is done)."""

    backend: str | None = None
    """The backend `auto` resolved to (None until resolved, or when resolving failed)."""
    seconds: float | None = None
    """How long the work took."""
    error: str | None = None
    """Why it stopped early (the load then does the work itself and reports the error)."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the thread is finished."""


def prewarm(backend: str = "auto", options: EngineOptions | None = None) -> str:
    """Resolve `backend` and do its per-process start-up work now; returns the backend's name."""
    from .backends import resolve_backend

    name = resolve_backend(backend, options)
    if name == "cupy":
        import cupy as cp

        from . import kernels
        from .backends import cupy_backend, cupy_decoder, cupy_sample  # noqa: F401 - imported ahead

        cp.cuda.runtime.free(0)  # creates the device's primary context
        kernels.kernel("argmax")  # the forward pass's module: NVRTC, or the kernel cache
        cupy_sample._module().get_function("smp_select")
    elif name == "native":
        from .backends.cpu_native import native_available

        native_available(options.native_cflags if options is not None else ())
    return name


def start_prewarm(backend: str = "auto", options: EngineOptions | None = None) -> Prewarm:
    """Run `prewarm` in a daemon thread; returns at once with the record it fills in."""
    rec = Prewarm()

    def work() -> None:
        t0 = time.perf_counter()
        try:
            rec.backend = prewarm(backend, options)
        except Exception as exc:  # the load repeats the work and raises it where it is handled
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            rec.seconds = time.perf_counter() - t0
            rec.done.set()

    threading.Thread(target=work, name="engine-prewarm", daemon=True).start()
    return rec
