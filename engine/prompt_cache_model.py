"""One loaded model's part of the prompt cache on disk (`engine.prompt_cache`): its `CacheKey`, the
index of its files, and the restore, offer and stable-prefix rules the module doc there describes."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import kv_file
from .kv_file import CacheKey, Rejected

if TYPE_CHECKING:
    from . import Model
    from .kv_cache import KVCache
    from .prompt_cache import PromptCache

READY_WAIT_S = 60.0
"""Longest a request waits for a just-attached cache's key and index (made once per load)."""
COPIES_AHEAD = 4
"""Host-to-device copies of a restore in flight at once (each keeps its page-locked buffer)."""
SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class Entry:
    """One file of a model's directory, its header checked."""

    path: Path
    tokens: np.ndarray
    """int32 token ids of the prefix."""
    nbytes: int


@dataclass(frozen=True)
class SaveJob:
    cache: ModelCache
    tokens: tuple[int, ...]
    arrays: list[tuple[str, np.ndarray]]
    sums: dict[str, int] | None = None
    """The arrays' device checksums (a GPU's cache), written with them."""


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    """Leading elements two int arrays share."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class ModelCache:
    """The prompt cache of one loaded model: its key, the index of its files, restore and offer."""

    def __init__(self, store: PromptCache, model: Model) -> None:
        self.store = store
        self.model = model
        self.name = model.info.name
        self.key: CacheKey | None = None
        """The model's key, once made."""
        self.directory: Path | None = None
        """Where its files are: the store's directory / the key's digest."""
        self.error: str | None = None
        """Why the cache could not be prepared (it then does nothing)."""
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._pending: set[str] = set()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._stable: OrderedDict[str, np.ndarray] = OrderedDict()

    # -- setup ----------------------------------------------------------------------------
    def prepare(self) -> None:
        try:
            key = kv_file.cache_key(self.model)
            directory = self.store.directory / key.digest()
            expect = kv_file.kv_arrays(self.model.transformer.kv)
            entries = {}
            for p in sorted(directory.glob(f"*{kv_file.SUFFIX}")) if directory.is_dir() else []:
                if p.name.startswith(kv_file.TMP_PREFIX):
                    self._drop_stale_tmp(p)
                    continue
                try:
                    h = kv_file.read_header(p, key, expect, self.model.info.n_vocab)
                except FileNotFoundError:
                    continue
                except Rejected as exc:
                    self.store.rejected(p, exc, self.name)
                    continue
                entries[p.name] = Entry(p, np.asarray(h.tokens, dtype=np.int32), h.size)
            with self._lock:
                self.key, self.directory, self._entries = key, directory, entries
            self.store.trim()
        except Exception as exc:  # noqa: BLE001 - no cache is better than no model
            self.error = f"{type(exc).__name__}: {exc}"
            self.store.event("prompt_cache_unavailable", model=self.name, error=self.error)
        finally:
            self._ready.set()

    @staticmethod
    def _drop_stale_tmp(p: Path) -> None:
        """A temporary file left by a writer that died (older than ten minutes)."""
        try:
            if time.time() - p.stat().st_mtime > 600:
                p.unlink()
        except OSError:
            pass

    def wait_ready(self, timeout: float = READY_WAIT_S) -> bool:
        """Whether the key and index are made (waits up to `timeout`)."""
        return self._ready.wait(timeout) and self.key is not None

    @property
    def entries(self) -> list[Entry]:
        """The files of this model now."""
        with self._lock:
            return list(self._entries.values())

    def done(self, name: str, entry: Entry | None) -> None:
        with self._lock:
            self._pending.discard(name)
            if entry is not None:
                self._entries[name] = entry

    def forget(self, path: Path) -> None:
        with self._lock:
            self._entries.pop(path.name, None)

    # -- use ------------------------------------------------------------------------------
    def restore(self, ids: Sequence[int], have: int, stable: int = 0) -> tuple[int, int]:
        """Put the file sharing the most leading tokens with `ids` into the KV cache when that is
        at least `min_tokens` and more than the `have` tokens it holds (blocking: call it in a
        worker thread while holding the model). `stable`: the prompt's stable prefix, for the
        miss count. Returns (tokens of `ids` the cache now holds, of which restored from disk)."""
        min_tokens = self.store.min_tokens
        if not self.wait_ready():
            return have, 0
        want = np.asarray(list(ids), dtype=np.int32)
        best, common = None, 0
        for e in self.entries:
            n = _shared(e.tokens, want)
            if n > common or (n == common and best is not None and e.nbytes < best.nbytes):
                best, common = e, n
        if best is None or common < min_tokens or common <= have:
            if stable >= min_tokens and have < stable:
                self.store.count(misses=1)
            return have, 0
        t0 = time.perf_counter()
        try:
            assert self.key is not None
            header = kv_file.read_header(best.path, self.key, self._expect(), self.model.info.n_vocab)
        except FileNotFoundError:
            self.forget(best.path)
            return have, 0
        except Rejected as exc:
            self.forget(best.path)
            self.store.rejected(best.path, exc, self.name)
            return have, 0
        pool = self.store.read_pool()

        waits = [0.0, 0.0]  # seconds waiting for reads (and checksums), seconds copying into the cache

        def put(kv: KVCache) -> int:
            ops = self.model.transformer.ops
            ops.synchronize()
            kv.tokens = []  # nothing of it is trusted until every array has checked out
            pairs = kv_file.kv_arrays(kv)
            arrays = dict(pairs)
            # into a GPU's cache: copies queued (a few in flight, each holding its host buffer) and
            # the device checksum of what arrived checked at the end, instead of a CRC per read
            device = not isinstance(pairs[0][1], np.ndarray) and all(s.dsum is not None for s in header.arrays)
            inflight: deque[Any] = deque()
            try:
                t = time.perf_counter()
                for spec, rows in kv_file.read_arrays(header, pool, kv_file.host_buffers(pairs[0][1]), crc=not device):
                    t1 = time.perf_counter()
                    inflight.append((rows, kv_file.rows_from_host(arrays[spec.name], rows, wait=not device)))
                    while len(inflight) > COPIES_AHEAD:
                        ev = inflight.popleft()[1]
                        if ev is not None:
                            ev.synchronize()
                    t2 = time.perf_counter()
                    waits[0] += t1 - t
                    waits[1] += t2 - t1
                    t = t2
            finally:
                ops.synchronize()
                inflight.clear()
            if device:
                t1 = time.perf_counter()
                got = kv_file.device_sums(pairs, len(header.tokens))
                waits[1] += time.perf_counter() - t1
                bad = next((s.name for s in header.arrays if got[s.name] != s.dsum), None)
                if bad is not None:
                    raise Rejected("checksum", f"{bad} does not match its checksum")
            kv.tokens = list(header.tokens)
            return kv.common_prefix(list(ids))

        try:
            now = self.model.with_kv(put)
        except Rejected as exc:
            self.forget(best.path)
            self.store.rejected(best.path, exc, self.name)
            return self.model.with_kv(lambda kv: kv.common_prefix(list(ids))), 0
        _touch(best.path)
        self.model.expect_chunk_at(now)
        ms = (time.perf_counter() - t0) * 1000
        self.store.count(hits=1, restored_tokens=now, bytes_read=header.size)
        self.store.event(
            "prompt_cache_restored",
            model=self.name,
            file=best.path.name,
            tokens=now,
            bytes=header.size,
            ms=round(ms, 1),
            read_wait_ms=round(waits[0] * 1000, 1),
            copy_ms=round(waits[1] * 1000, 1),
        )
        return now, now

    def _expect(self) -> list[tuple[str, Any]]:
        return kv_file.kv_arrays(self.model.transformer.kv)

    def offer(self, prefix: Sequence[int]) -> bool:
        """Queue `prefix` (whose K/V the cache holds) to be written, unless it is shorter than
        `min_tokens`, already on disk (then it counts as used), too large for the bound, or not
        yet seen twice while a file shares `min_tokens` of it (module doc). The rows are copied
        to the host here (blocking: call it in a worker thread); the file is written later by
        the writer thread. Returns whether a write was queued."""
        store, tokens = self.store, tuple(int(t) for t in prefix)
        n = len(tokens)
        if n < store.min_tokens or not self._ready.is_set() or self.key is None:
            return False
        name = kv_file.tokens_name(tokens)
        want = np.asarray(tokens, dtype=np.int32)
        with self._lock:
            entry = self._entries.get(name)
            if entry is None and name in self._pending:
                return False
            overlap = max((_shared(e.tokens, want) for e in self._entries.values()), default=0)
            if entry is None and overlap >= store.min_tokens and name not in self._seen:
                self._seen[name] = None
                while len(self._seen) > 64:
                    self._seen.popitem(last=False)
                return False
        if entry is not None:
            _touch(entry.path)
            return False
        if n * self.model.transformer.kv.token_bytes() > store.max_bytes:
            store.event("prompt_cache_skipped", model=self.name, tokens=n, reason="larger than max_bytes")
            return False

        def copy(kv: KVCache) -> tuple[list[tuple[str, np.ndarray]], dict[str, int] | None] | None:
            if kv.common_prefix(list(tokens)) < n:
                return None
            self.model.transformer.ops.synchronize()
            pairs = kv_file.kv_arrays(kv)
            sums = None if isinstance(pairs[0][1], np.ndarray) else kv_file.device_sums(pairs, n)
            return [(a_name, kv_file.rows_to_host(a, n)) for a_name, a in pairs], sums

        copied = self.model.with_kv(copy)
        if copied is None:
            return False
        arrays, sums = copied
        with self._lock:
            self._pending.add(name)
        if not store.enqueue(SaveJob(self, tokens, arrays, sums)):
            self.done(name, None)
            store.event("prompt_cache_skipped", model=self.name, tokens=n, reason="writer busy")
            return False
        return True

    def stable_prefix(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None, ids: Sequence[int]
    ) -> int:
        """Tokens of `ids` that belong to the conversation's leading system message(s) and tools:
        the prompt rendered up to that boundary (no generation prompt), as far as it agrees with
        `ids`; 0 without system messages or tools, or when the template cannot render them alone."""
        lead = []
        for m in messages:
            if m.get("role") not in SYSTEM_ROLES:
                break
            lead.append(dict(m))
        if not lead and not tools:
            return 0
        memo = json.dumps([lead, tools], sort_keys=True, default=str)
        with self._lock:
            toks = self._stable.get(memo)
            if toks is not None:
                self._stable.move_to_end(memo)
        if toks is None:
            toks = np.zeros(0, dtype=np.int32)
            try:
                text = self.model.render_chat(lead, add_generation_prompt=False, tools=tools)
                ids0 = self.model.tokenizer.encode(text, add_special=True, parse_special=True)
                bos = self.model.tokenizer.bos_id
                if bos is not None and len(ids0) > 1 and ids0[0] == bos and ids0[1] == bos:
                    ids0 = ids0[1:]
                toks = np.asarray(ids0, dtype=np.int32)
            except Exception:  # noqa: BLE001 - a template that needs a user turn: no stable prefix
                pass
            with self._lock:
                self._stable[memo] = toks
                while len(self._stable) > 16:
                    self._stable.popitem(last=False)
        return _shared(toks, np.asarray(list(ids), dtype=np.int32))


def _touch(path: Path) -> None:
    """Mark a file used now (the least recently used go first)."""
    try:
        os.utime(path)
    except OSError:
        pass
