"""The daemon's prompt cache on disk (`engine.prompt_cache`), made from the config's ``prompt_cache``
section: where it lives, its log events, and its counters as /status and /metrics show them.

One `PromptCache` serves every builtin model (each model's files sit under its key's digest);
`EngineHost` attaches it to a model once loaded and passes the model's cache and the request's
stable prefix (the leading system messages and tools) to every generation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog

from engine.prompt_cache import PromptCache

from ..config import PromptCacheConfig

log = structlog.get_logger(__name__)

SUBDIR = "prompt-cache"


def default_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$GENIE_PROMPT_CACHE_DIR``, else ``$CACHE_DIRECTORY/prompt-cache`` (systemd's CacheDirectory=,
    the first when it lists several), else ``${XDG_CACHE_HOME:-~/.cache}/genie-supervisor/prompt-cache``."""
    if environ.get("GENIE_PROMPT_CACHE_DIR"):
        return Path(environ["GENIE_PROMPT_CACHE_DIR"])
    systemd = environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if systemd:
        return Path(systemd) / SUBDIR
    xdg = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "genie-supervisor" / SUBDIR


def _log_event(name: str, fields: dict[str, Any]) -> None:
    if name in ("prompt_cache_rejected", "prompt_cache_save_failed", "prompt_cache_unavailable"):
        log.warning(name, **fields)
    else:
        log.info(name, **fields)


def open_prompt_cache(cfg: PromptCacheConfig, environ: Mapping[str, str] = os.environ) -> PromptCache | None:
    """The store the config asks for (None when disabled); nothing is read or made on disk yet."""
    if not cfg.enabled:
        return None
    directory = Path(os.path.expanduser(os.path.expandvars(cfg.dir))) if cfg.dir else default_dir(environ)
    return PromptCache(directory, cfg.max_bytes, cfg.min_tokens, on_event=_log_event)


def describe(store: PromptCache | None) -> dict[str, Any]:
    """The store's settings and counters for /status (``enabled: false`` without one)."""
    if store is None:
        return {"enabled": False}
    s = store.stats()
    return {
        "enabled": True,
        "dir": str(store.directory),
        "max_bytes": store.max_bytes,
        "min_tokens": store.min_tokens,
        "bytes": s.bytes,
        "files": s.files,
        "hits": s.hits,
        "misses": s.misses,
        "saves": s.saves,
        "rejects": s.rejects,
        "reject_reasons": dict(s.reject_reasons),
        "evictions": s.evictions,
        "restored_tokens": s.restored_tokens,
        "bytes_read": s.bytes_read,
        "bytes_written": s.bytes_written,
    }
