"""The first thing ``genie-supervisor run`` does: start the start model's load before the daemon's
heavy imports.

`start(config, overrides)` reads only what the early load needs from the config YAML and the
policy YAML (no validation, standard library and PyYAML only: no pydantic, FastAPI, uvicorn,
aiomqtt, llguidance), points the kernel caches at their folder, and starts the prewarm thread,
which imports the engine itself and then runs `engine.prewarm.run_prewarm` (CUDA context,
kernels, then the one model that loads at the start if its plan fits the policy's budget). The
daemon meanwhile imports and validates the real config; `startup.prepare` then compares what the
validated config and policy ask for with this guess and disowns the early model if anything
differs (it is dropped, the model manager loads as usual). Anything unusual (several start
models, a remote backend, ``$VARIABLES`` in paths, a value of an unexpected type, an unreadable
file) makes `start` do nothing: `prepare` then starts the prewarm as before.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.prewarm import Prewarm

N_CTX, KV_DTYPE, CHUNK, BUDGET_MB = 4096, "f16", 64, 2560.0
"""The schema's defaults of engine.n_ctx, engine.kv_dtype, the policy's prefill chunk and LLM
budget (tests/test_boot.py checks them against the schemas: `DEFAULTS`)."""
DEFAULTS: dict[str, object] = {"n_ctx": N_CTX, "kv_dtype": KV_DTYPE, "chunk": CHUNK, "budget_mb": BUDGET_MB}
_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Guess:
    """The early load the raw config and policy ask for."""

    backend: str
    path: str
    n_ctx: int
    kv_dtype: str
    threads: int | None
    chunk: int
    budget_mb: float
    kernel_cache_dir: str | None


_record: list[Prewarm] = []
_published = threading.Event()
_started = False


def _yaml(path: str) -> Any:
    st = os.stat(path)  # only a regular file of reasonable size (a FIFO must not hang the start)
    if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES:
        raise ValueError(path)
    import yaml

    with open(path, encoding="utf-8") as fh:
        return yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _int(v: Any, default: int | None) -> int | None:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(v)
    return v


def _path(v: Any, base: Path | None) -> str:
    if not isinstance(v, str) or not v or "$" in v:
        raise ValueError(v)
    return v if os.path.isabs(v) or base is None else str(base / v)


def _dict(v: Any) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError(v)
    return v


def guess(config: str | None, overrides: dict[str, Any]) -> Guess | None:
    """The early load of this config (None: none, or anything unusual)."""
    try:
        return _guess(config, overrides)
    except Exception:  # unreadable, not YAML, a value of another type: the real config says why
        return None


def _guess(config: str | None, overrides: dict[str, Any]) -> Guess | None:
    data = _dict(_yaml(config)) if config else {}
    base = Path(config).parent if config else None
    engine = _dict(data.get("engine"))
    if engine.get("prewarm", True) is not True:
        return None
    top = data.get("backend", "builtin")
    n_ctx, kv = _int(engine.get("n_ctx"), N_CTX), engine.get("kv_dtype", KV_DTYPE)
    models = _dict(data.get("models"))
    if models:
        start, groups = [], set()
        for e in map(_dict, models.values()):
            if e.get("resident") is True or (e.get("preload") is True and (e.get("group") not in groups)):
                start.append(e)
                if e.get("group") is not None:
                    groups.add(e["group"])
        if len(start) != 1 or (start[0].get("backend") or top) != "builtin":
            return None
        path = _path(start[0].get("path"), base)
        n_ctx = _int(start[0].get("n_ctx"), n_ctx)
        kv = start[0].get("kv_dtype") or kv
    else:
        if top != "builtin":
            return None
        model = overrides.get("model")
        path = _path(model, None) if model else _path(engine.get("model"), base)
    backend = engine.get("backend", "auto")
    if backend not in ("auto", "numpy", "native", "cupy") or kv not in ("f16", "int8") or n_ctx is None:
        return None
    policy_path = overrides.get("policy") or _dict(data.get("policy")).get("path")
    policy = _dict(_yaml(_path(policy_path, None if overrides.get("policy") else base))) if policy_path else {}
    chunk = _int(_dict(policy.get("voice")).get("prefill_chunk_tokens"), CHUNK)
    budget = _dict(policy.get("memory")).get("llm_budget_mb", BUDGET_MB)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or chunk is None:
        return None
    cache = engine.get("kernel_cache_dir")
    if cache is not None and not isinstance(cache, str):
        return None
    threads = _int(engine.get("threads"), None)
    return Guess(str(backend), path, n_ctx, str(kv), threads, chunk, float(budget), cache)


def start(config: str | None, overrides: dict[str, Any]) -> Guess | None:
    """Start the prewarm thread with the early load of this config, if there is one (once per
    process); returns the guess it started (None: nothing started, `prepare` does as before)."""
    global _started
    g = None if _started else guess(config, overrides)
    if g is None:
        return None
    _started = True
    from .startup import kernel_cache_dir, use_kernel_cache

    use_kernel_cache(kernel_cache_dir(g.kernel_cache_dir))
    _keep_early_logs()
    threading.Thread(target=_work, args=(g,), name="engine-prewarm", daemon=True).start()
    # The daemon's own imports (config, errors, app) import engine modules too. Two threads importing
    # one package's modules in different orders can deadlock on Python's module locks (seen: a
    # _DeadlockError on engine.errors killed the early load), so the caller goes on once the thread
    # has imported the engine; the load itself (weights, CUDA context) still overlaps the rest.
    _published.wait(IMPORT_WAIT_S)
    return g


IMPORT_WAIT_S = 30.0
"""How long `start` waits for the prewarm thread's engine imports (then goes on regardless)."""
import_error: list[str] = []
"""Why the prewarm thread's imports failed, if they did (the daemon then loads as if none had started)."""


class _EarlyLogs(logging.handlers.BufferingHandler):
    """What is logged (the prewarm thread's engine warnings) before the daemon configures logging:
    kept, up to its capacity, and handed to `configure_logging` by `take_early_logs`."""

    def shouldFlush(self, record: logging.LogRecord) -> bool:  # noqa: N802 (the stdlib's name)
        """Never flush by itself: the records wait for the configured handler."""
        return False

    def emit(self, record: logging.LogRecord) -> None:
        """Keep `record` while there is room (the rest is dropped: a bound, not a loss of the first ones)."""
        if len(self.buffer) < self.capacity:
            self.buffer.append(record)


_early_logs: list[_EarlyLogs] = []


def _keep_early_logs() -> None:
    """Buffer the root logger's records until `configure_logging` takes them, unless logging is set up already."""
    root = logging.getLogger()
    if root.handlers or _early_logs:
        return
    handler = _EarlyLogs(capacity=10_000)
    _early_logs.append(handler)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)  # configure_logging sets the real level and filters what was kept


def take_early_logs() -> list[logging.LogRecord]:
    """The records kept since `start` (the buffer is detached; empty when nothing was kept)."""
    if not _early_logs:
        return []
    handler = _early_logs.pop()
    logging.getLogger().removeHandler(handler)
    handler.acquire()
    try:
        records, handler.buffer = list(handler.buffer), []
    finally:
        handler.release()
    return records


def _work(g: Guess) -> None:
    try:  # the engine's imports happen here, in this thread, before the daemon imports its own
        from dataclasses import replace

        from engine.options import EngineOptions
        from engine.prewarm import EarlyLoad, Prewarm, run_prewarm

        options = replace(EngineOptions.from_env(), prefill_chunk=g.chunk)
        early = EarlyLoad(g.path, g.n_ctx, g.kv_dtype, g.threads, budget_bytes=int(g.budget_mb * 1024 * 1024))
        rec = Prewarm(early=early, options=options, backend_asked=g.backend)
        _record.append(rec)
    except Exception as exc:  # `record` returns None: the daemon's own load does the work
        import_error.append(f"{type(exc).__name__}: {exc}")
        return
    finally:
        _published.set()
    run_prewarm(rec)


def record(timeout: float = 60.0) -> Prewarm | None:
    """The record of the prewarm thread `start` started (None: none started, or its imports failed)."""
    if not _started or not _published.wait(timeout):
        return None
    return _record[0] if _record else None
