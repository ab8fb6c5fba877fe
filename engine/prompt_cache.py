"""A prompt cache that survives restarts: the K/V rows of a conversation's stable prefix on disk,
per model, put back into the KV cache instead of prefilling them again.

    store = PromptCache(directory, max_bytes=2 << 30, min_tokens=256, on_event=log)
    cache = store.attach(model)        # key and index made in a background thread
    n = cache.stable_prefix(messages, tools, ids)       # the system message(s) and tools, in tokens
    model.generate(ids, sampling, prompt_cache=cache, save_prefix=n)  # restored when it helps, saved after prefill

A generation first takes what the KV cache and the pinned prefix hold, then (`ModelCache.restore`)
the file whose token ids share the most leading tokens with its prompt, when that is at least
`min_tokens` and more than memory holds. After its prefill, `save_prefix` tokens are offered
(`ModelCache.offer`): their rows are copied to the host and written by one writer thread
(`engine.kv_file`: checksummed, atomic rename), then the directory is trimmed to `max_bytes`
(least recently used first; a restore or a repeated offer counts as a use). A prefix that shares
`min_tokens` or more with a file already there is written only when it is offered a second time:
an edited system prompt comes back, a timestamp inside one does not (its shared part is restored
from the older file either way).

Every file is checked against the model's `CacheKey` before use (`kv_file.read_header`); a file
that fails any check is deleted and counted under its reason.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import kv_file
from .kv_file import Rejected
from .prompt_cache_model import Entry, ModelCache, SaveJob

__all__ = ["CacheStats", "ModelCache", "PromptCache"]

if TYPE_CHECKING:
    from . import Model

DEFAULT_MIN_TOKENS = 256

EventSink = Callable[[str, dict[str, Any]], None]


@dataclass
class CacheStats:
    """Counters of one store since it was made, and its size on disk now."""

    hits: int = 0
    """Prompts whose prefix came back from a file."""
    misses: int = 0
    """Prompts with a stable prefix of `min_tokens` or more that neither memory nor disk held."""
    saves: int = 0
    """Files written."""
    rejects: int = 0
    """Files refused (and deleted); by reason in `reject_reasons`."""
    evictions: int = 0
    """Files deleted to stay within `max_bytes`."""
    restored_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes: int = 0
    """Bytes of cache files on disk now."""
    files: int = 0
    """Cache files on disk now."""
    reject_reasons: dict[str, int] = field(default_factory=dict)


class PromptCache:
    """The directory of cache files of every model, bounded to `max_bytes`, with one writer thread."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_bytes: int,
        min_tokens: int = DEFAULT_MIN_TOKENS,
        on_event: EventSink | None = None,
        read_threads: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        """Holds one sub-directory per `CacheKey` digest."""
        self.max_bytes = int(max_bytes)
        """Bound of the files' total size."""
        self.min_tokens = max(1, int(min_tokens))
        """Shortest prefix saved or restored."""
        self.on_event = on_event or (lambda _name, _fields: None)
        """Called with (event, fields) on every save, restore, reject and eviction (any thread)."""
        self._read_threads = read_threads or min(8, os.cpu_count() or 1)
        self._lock = threading.Condition()
        self._stats = CacheStats()
        self._queue: queue.Queue[SaveJob] = queue.Queue(maxsize=2)
        self._busy = 0
        self._writer: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._caches: weakref.WeakSet[ModelCache] = weakref.WeakSet()
        self._measured = False

    def attach(self, model: Model) -> ModelCache:
        """A cache for `model` (pass it to `model.generate`); its key and index are made in a
        background thread (requests wait for them at most `READY_WAIT_S`)."""
        cache = ModelCache(self, model)
        with self._lock:
            self._caches.add(cache)
        threading.Thread(target=cache.prepare, name="prompt-cache-index", daemon=True).start()
        return cache

    def stats(self) -> CacheStats:
        """A copy of the counters."""
        with self._lock:
            s = self._stats
            return CacheStats(**{**s.__dict__, "reject_reasons": dict(s.reject_reasons)})

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued file is written; False if that took longer than `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    # -- what its model caches use -------------------------------------------------------
    def event(self, name: str, **fields: Any) -> None:
        try:
            self.on_event(name, fields)
        except Exception:  # noqa: BLE001 - a log sink must not break a generation
            pass

    def count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def rejected(self, path: Path, exc: Rejected, model: str) -> None:
        """Count, log and delete a refused file (the next save replaces it)."""
        size = 0
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            pass
        with self._lock:
            self._stats.rejects += 1
            self._stats.reject_reasons[exc.reason] = self._stats.reject_reasons.get(exc.reason, 0) + 1
            if size and self._measured:
                self._stats.bytes -= size
                self._stats.files -= 1
        self.event("prompt_cache_rejected", model=model, file=path.name, reason=exc.reason, detail=exc.detail)

    def close(self) -> None:
        """End the read threads (idle ones exit now; a read under way finishes first). The pool's
        threads are not daemon threads: left running they hold the process's exit until its
        shutdown bound forces it. A later restore starts a new pool."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def read_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._read_threads, thread_name_prefix="prompt-cache-read")
            return self._pool

    def enqueue(self, job: SaveJob) -> bool:
        with self._lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="prompt-cache-write", daemon=True)
                self._writer.start()
            self._busy += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                self._busy -= 1
                self._lock.notify_all()
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self._write(job)
            finally:
                with self._lock:
                    self._busy -= 1
                    self._lock.notify_all()

    def _write(self, job: SaveJob) -> None:
        cache = job.cache
        name = kv_file.tokens_name(job.tokens)
        t0 = time.perf_counter()
        try:
            assert cache.key is not None and cache.directory is not None
            path = kv_file.write(cache.directory, cache.key, job.tokens, job.arrays, job.sums)
            size = path.stat().st_size
        except (OSError, AssertionError) as exc:
            self.event("prompt_cache_save_failed", model=cache.name, error=f"{type(exc).__name__}: {exc}")
            cache.done(name, None)
            return
        cache.done(name, Entry(path, np.asarray(job.tokens, dtype=np.int32), size))
        self.count(saves=1, bytes_written=size)
        self.event(
            "prompt_cache_saved",
            model=cache.name,
            file=path.name,
            tokens=len(job.tokens),
            bytes=size,
            ms=round((time.perf_counter() - t0) * 1000, 1),
        )
        self.trim(keep=path)

    def trim(self, keep: Path | None = None) -> None:
        """Measure the directory and delete the least recently used files beyond `max_bytes`."""
        files = []
        for p in self.directory.glob(f"*/*{kv_file.SUFFIX}"):
            if p.name.startswith(kv_file.TMP_PREFIX):
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, p, st.st_size))
        files.sort()
        total = sum(size for _, _, size in files)
        kept = len(files)
        for _, p, size in files:
            if total <= self.max_bytes:
                break
            if p == keep:
                continue
            try:
                p.unlink()
            except OSError:
                continue
            total, kept = total - size, kept - 1
            self.count(evictions=1)
            with self._lock:
                caches = list(self._caches)
            for c in caches:
                c.forget(p)
            self.event("prompt_cache_evicted", file=p.name, bytes=size)
        with self._lock:
            self._stats.bytes, self._stats.files, self._measured = total, kept, True
