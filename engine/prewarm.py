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

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .options import EngineOptions


@dataclass(frozen=True)
class EarlyLoad:
    """A model to load right after the prewarm, if its memory plan fits `budget_bytes`."""

    path: str
    n_ctx: int
    kv_dtype: str
    threads: int | None
    budget_bytes: int
    """The plan (for the options' prefill chunk) must fit this, else nothing is loaded early."""

    def matches(self, path: str, n_ctx: int, kv_dtype: str, threads: int | None) -> bool:
        """Whether a load of these parameters is this one."""
        return (os.fspath(path), n_ctx, kv_dtype, threads) == (self.path, self.n_ctx, self.kv_dtype, self.threads)


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
    early: EarlyLoad | None = None
    """The model asked to load early, if any."""
    options: EngineOptions | None = None
    """The options it was (to be) loaded with."""
    model: Any = None
    """The early-loaded `engine.Model` until someone takes it (`take`)."""
    load_s: float | None = None
    """How long the early load took (None: not loaded early)."""
    skipped: str | None = None
    """Why the early load did not happen (its plan over the budget, an error)."""

    def take(
        self, backend: str, options: EngineOptions | None, path: str, n_ctx: int, kv: str, threads: int | None
    ) -> Any:
        """The early-loaded model for a load of these parameters (waiting for the thread to finish),
        once; None when there is none or it was made otherwise."""
        e = self.early
        if (
            e is None
            or self.disowned is not None
            or self.backend_asked != backend
            or self.options != options
            or not e.matches(path, n_ctx, kv, threads)
        ):
            return None
        self.done.wait()
        model, self.model = self.model, None
        return model

    backend_asked: str = "auto"
    """The backend name the prewarm was asked for (a load asking for another one does not match)."""
    disowned: str | None = None
    """Why nobody may take the early model (set by `disown`): it is dropped instead."""

    context_s: float | None = None
    """How long the driver took to create the CUDA context in the prewarm's own thread
    (`driver_context`; None: not asked for, not finished, or no CUDA driver)."""

    reader: _Reader | None = None
    """The early model's header and tokenizer being made (None: no early load)."""
    reader_known: threading.Event = field(default_factory=threading.Event)
    """Set once the thread has started its reader (or decided on none)."""

    def header(self, path: str) -> Any:
        """The early load's GGUF header of `path` (waiting for its reader), once, so that the
        daemon's plan at start does not parse the header again; None for another file, a file
        changed since it was read, a second call, or when reading it failed."""
        self.reader_known.wait()
        r, self.reader = self.reader, None
        if r is None or self.early is None or os.fspath(path) != self.early.path:
            return None
        from .gguf_file import file_identity

        try:
            header = r.header_result()
            return header if header.identity == file_identity(self.early.path) else None
        except BaseException:  # noqa: BLE001 - the caller reads the header itself and reports why
            return None

    def disown(self, why: str) -> None:
        """Refuse the early model to every `take` (e.g. the full config asks for another load) and
        drop it, now or when its load ends."""
        self.disowned = self.skipped = why
        self.model = None


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


class _Reader:
    """The early model's header and tokenizer, made in a thread of their own while the prewarm
    creates the CUDA context and loads the kernels (driver calls that release the GIL): the
    GGUF's vocabulary and the tokenizer are ~0.2 s of Python for a 150k-token vocabulary. The
    header is handed over as soon as it is read (the plan and the weights need nothing else); the
    tokenizer is waited for only once the weights are on the device."""

    def __init__(self, path: str) -> None:
        self.header: Any = None
        self.tokenizer: Any = None
        self.error: BaseException | None = None
        """Why the header could not be read (then no tokenizer is built)."""
        self.tokenizer_error: BaseException | None = None
        self._header_done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(path,), name="engine-header", daemon=True)
        self._thread.start()

    def _run(self, path: str) -> None:
        from . import open_model_file
        from .tokenizer import Tokenizer

        try:
            self.header = open_model_file(path)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the load, where it is reported
            self.error = exc
            return
        finally:
            self._header_done.set()
        try:
            self.tokenizer = Tokenizer.from_gguf(self.header)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the load, where it is reported
            self.tokenizer_error = exc

    def header_result(self) -> Any:
        """The header, once read; raises what reading it raised."""
        self._header_done.wait()
        if self.error is not None:
            raise self.error
        return self.header

    def tokenizer_result(self) -> Any:
        """The tokenizer, once the thread is done; raises what reading the header or building it raised."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        if self.tokenizer_error is not None:
            raise self.tokenizer_error
        return self.tokenizer


def load_early(rec: Prewarm, reader: _Reader | None = None) -> None:
    """Load `rec.early` if its plan fits its budget (the record says what happened); `reader`:
    its header and tokenizer being made already."""
    from . import load_model
    from .model import plan_on

    e = rec.early
    assert e is not None and rec.backend is not None
    t0 = time.perf_counter()
    reader = reader or _Reader(e.path)
    header = reader.header_result()
    plan = plan_on(header, e.n_ctx, e.kv_dtype, rec.backend, rec.options)
    if plan.total > e.budget_bytes:
        rec.skipped = f"plan {plan.total} bytes over the budget {e.budget_bytes}"
        return
    kwargs: dict[str, Any] = {"threads": e.threads} if e.threads else {}
    model = load_model(
        e.path,
        backend=rec.backend_asked,
        n_ctx=e.n_ctx,
        kv_dtype=e.kv_dtype,
        options=rec.options,
        gguf=header,
        tokenizer=reader.tokenizer_result,
        **kwargs,
    )
    rec.load_s = time.perf_counter() - t0
    if rec.disowned is None:  # disowned while loading: dropped here
        rec.model = model


def start_prewarm(
    backend: str = "auto", options: EngineOptions | None = None, early: EarlyLoad | None = None
) -> Prewarm:
    """Run `prewarm` in a daemon thread, then load `early` if its plan fits; returns at once with
    the record it fills in (`Prewarm.take` hands the model over)."""
    rec = Prewarm(early=early, options=options, backend_asked=backend)
    threading.Thread(target=run_prewarm, args=(rec,), name="engine-prewarm", daemon=True).start()
    return rec


def _driver_device(ordinal: int) -> tuple[Any, Any] | None:
    """libcuda (by ctypes, which releases the GIL for its calls) and device `ordinal`'s handle, the
    driver initialised; None without a driver library or that device."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev = ctypes.c_int()
    if lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(dev), ordinal):
        return None
    return lib, dev


def driver_context(ordinal: int = 0) -> float | None:
    """Create device `ordinal`'s primary CUDA context through the driver (`_driver_device`) and
    keep it retained for the process; returns the seconds it took, None when there is no driver or
    device (nothing raised). CuPy's first runtime call then finds the context made: run in a thread
    while CuPy is imported, the context's creation (~0.2 s on an H200, more on a Jetson) no longer
    follows the import."""
    import ctypes

    t0 = time.perf_counter()
    found = _driver_device(ordinal)
    if found is None:
        return None
    lib, dev = found
    if lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctypes.c_void_p()), dev):
        return None
    return time.perf_counter() - t0


CONTEXT_WAIT_S = 30.0
"""How long the prewarm waits, at its end, for the driver's context creation (normally long done)."""


def release_driver_context(ordinal: int = 0) -> None:
    """Give back the retain `driver_context` took (the context goes when nothing else holds it)."""
    found = _driver_device(ordinal)
    if found is not None:
        lib, dev = found
        lib.cuDevicePrimaryCtxRelease(dev)


def _start_driver_context(rec: Prewarm) -> threading.Thread | None:
    """Start `driver_context` in a daemon thread of its own, where the prewarm may use CUDA."""
    if rec.backend_asked not in ("auto", "cupy"):
        return None
    if rec.backend_asked == "auto":  # no context for a process that will not use CuPy (memory on a Jetson)
        from importlib.util import find_spec

        if find_spec("cupy") is None:
            return None

    def run() -> None:
        rec.context_s = driver_context()

    thread = threading.Thread(target=run, name="engine-cuda-context", daemon=True)
    thread.start()
    return thread


def run_prewarm(rec: Prewarm) -> None:
    """The prewarm thread's work on `rec` (what `start_prewarm` runs): `prewarm`, then the early
    load; whatever fails is kept in the record, and `rec.done` is set at the end."""
    t0 = time.perf_counter()
    context = None
    try:
        context = _start_driver_context(rec)
        reader = _Reader(rec.early.path) if rec.early is not None and rec.disowned is None else None
        rec.reader = reader
        rec.reader_known.set()
        rec.backend = prewarm(rec.backend_asked, rec.options)
        rec.seconds = time.perf_counter() - t0
        if rec.early is not None and rec.disowned is None:
            load_early(rec, reader)
    except Exception as exc:  # the daemon's own load repeats the work and raises it where it is handled
        rec.error = rec.skipped = f"{type(exc).__name__}: {exc}"
        # the reader keeps the exception it raised: without its frames, so a load that failed
        # late (the tokenizer, after the weights) holds nothing of its model (the collector is
        # off until ready, and what is alive then is frozen)
        exc.__traceback__ = None
    finally:
        rec.reader_known.set()
        if rec.seconds is None:
            rec.seconds = time.perf_counter() - t0
        if context is not None:
            context.join(CONTEXT_WAIT_S)  # `context_s` is known once `done` is set
            if rec.backend != "cupy" and rec.context_s is not None:
                release_driver_context()  # CPU after all (or CuPy failed): the context goes
        rec.done.set()
