"""A GGUF's long string arrays (the vocabulary, the BPE merges) kept parsed on disk, so that a
restart does not decode them string by string again.

A GGUF stores each string as a length and its bytes, so reading a vocabulary is one Python step per
string, holding the GIL: 0.16-0.22 s for Gemma-3's 262,144 tokens on a 2-core CI machine, 0.15 s
for a Qwen3 vocabulary on the H200's host, while the daemon's other start-up work waits for the
same GIL. `StringsCache` keeps each array of at least `MIN_STRINGS` strings as one file holding:
where the array starts and ends in the model file, the BLAKE2b digest of those bytes of the file,
the strings as `marshal` data and that data's own digest. A lookup hashes the model file's bytes at
that place again (a few ms: hashlib releases the GIL) and takes the strings only when both digests
agree and the data is a list of that many strings; anything else (no entry, another file at that
path, a truncated or corrupt entry) is a miss and the caller parses the array as before, and the
entry is written again. An entry is written by a background thread from its own copy of the
file's bytes, parsed again there, so its digest and its strings always come from the same bytes
(a file rewritten while it was read cannot pair new bytes with old strings); temporary file, then
rename; at most `MAX_ENTRIES` are kept, the least recently used dropped, and one process writes at
most `MAX_PER_FILE` entries of one model file. The folder is used only when it belongs to this
user and nobody else may write to it (it is made mode 0700): the digests detect damage, not
tampering, and `marshal` data must come from this user.

The daemon points it at ``<kernel cache>/strings`` (``$GENIE_STRINGS_CACHE_DIR``); unset, nothing
is cached.
"""

from __future__ import annotations

import hashlib
import logging
import marshal
import os
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIN_STRINGS = 4096
"""Shorter arrays are parsed every time (the lookup would cost what it saves)."""
MAX_ENTRIES = 16
"""Entries kept in the folder (two per model: tokens and merges)."""
MAX_PER_FILE = 4
"""Entries one process writes for one model file (a file of many long arrays caches the first)."""
MAX_ENTRY_BYTES = 256 << 20
"""A larger entry file is not read (a miss)."""
ENV = "GENIE_STRINGS_CACHE_DIR"
"""The folder, when set."""

_MAGIC = b"GGUFSTR1"
_HEAD = struct.Struct("<8sQQQ32s32s")  # magic, start, end, count, digest of the file's bytes, of the data
_log = logging.getLogger(__name__)


def _digest(data: memoryview | bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


class StringsCache:
    """Parsed string arrays of GGUF files in `folder` (see the module)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.hits = 0
        """Arrays served from the folder since this object was made."""
        self._writers: list[threading.Thread] = []
        self._written: dict[str, int] = {}  # entries written per model file by this process
        self._warned = False
        self._lock = threading.Lock()

    def _entry(self, path: str, start: int, count: int) -> Path:
        key = f"{os.path.realpath(path)}\0{start}\0{count}".encode("utf-8", "surrogateescape")
        return self.folder / (hashlib.sha256(key).hexdigest()[:32] + ".strings")

    def _ours(self) -> bool:
        """The folder exists, belongs to this user and nobody else may write to it."""
        try:
            st = os.stat(self.folder)
        except OSError:
            return False
        uid = getattr(os, "getuid", None)
        return stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o022 and (uid is None or st.st_uid == uid())

    def lookup(self, path: str, buf: memoryview, start: int, count: int) -> tuple[list[str], int] | None:
        """The `count` strings of `path`'s array at byte `start` (`buf`: the whole file) and the
        byte after them, when a valid entry for exactly those bytes exists; else None."""
        if not self._ours():
            return None
        entry = self._entry(path, start, count)
        try:
            with open(entry, "rb") as fh:
                if os.fstat(fh.fileno()).st_size > MAX_ENTRY_BYTES:
                    return None
                data = fh.read()
        except OSError:
            return None
        try:
            if len(data) < _HEAD.size:
                return None
            magic, s, end, n, src, dig = _HEAD.unpack_from(data)
            payload = memoryview(data)[_HEAD.size :]
            if magic != _MAGIC or s != start or n != count or not start < end <= len(buf):
                return None
            if _digest(buf[start:end]) != src or _digest(payload) != dig:
                return None
            strings = marshal.loads(payload)
            if type(strings) is not list or len(strings) != count or not all(type(x) is str for x in strings):
                return None
        except Exception:  # noqa: BLE001 - any damage is a miss: the array is parsed instead
            return None
        try:
            os.utime(entry)  # recently used
        except OSError:
            pass
        with self._lock:
            self.hits += 1
        return strings, end

    def store(
        self, path: str, buf: memoryview, start: int, end: int, count: int, parse: Callable[[memoryview], Any]
    ) -> None:
        """Write the entry for `path`'s `count`-string array at [start, end) in a background thread,
        which parses its own copy of those bytes with `parse` (-> (strings, bytes consumed)).
        Never raises: a failure costs the next start a parse."""
        try:
            key = os.path.realpath(path)
            with self._lock:
                if self._written.get(key, 0) >= MAX_PER_FILE:
                    return
                self._written[key] = self._written.get(key, 0) + 1
            src = bytes(buf[start:end])
            t = threading.Thread(
                target=self._write, args=(path, src, start, end, count, parse), name="strings-cache", daemon=False
            )  # not a daemon thread: a process that exits right after its start still writes the entry
            with self._lock:
                self._writers = [w for w in self._writers if w.is_alive()] + [t]
            t.start()
        except Exception as exc:  # noqa: BLE001 - the cache must never fail a load
            self._warn(f"cannot start the write: {exc}")

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the writes started so far."""
        with self._lock:
            writers = list(self._writers)
        for w in writers:
            w.join(timeout)

    def _warn(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            _log.warning("strings cache %s: %s (the vocabulary is parsed at every start)", self.folder, why)

    def _write(
        self, path: str, src: bytes, start: int, end: int, count: int, parse: Callable[[memoryview], Any]
    ) -> None:
        entry = self._entry(path, start, count)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            strings, used = parse(memoryview(src))
            if used != len(src) or len(strings) != count:
                return
            payload = marshal.dumps(strings)
            head = _HEAD.pack(_MAGIC, start, end, count, _digest(src), _digest(payload))
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self._ours():
                self._warn("the folder is not this user's alone")
                return
            with open(tmp, "wb") as fh:
                fh.write(head)
                fh.write(payload)
            os.replace(tmp, entry)
            self._trim()
        except Exception as exc:  # noqa: BLE001 - a read-only or full disk costs the next start a parse
            self._warn(f"cannot write {entry.name}: {exc}")
            try:
                tmp.unlink()
            except OSError:
                pass

    def _trim(self) -> None:
        """Drop the least recently used entries beyond `MAX_ENTRIES` (and stale temporary files)."""
        entries = []
        for p in self.folder.iterdir():
            try:
                st = p.stat()
            except OSError:
                continue
            if p.name.endswith(".strings"):
                entries.append((st.st_mtime_ns, p))
            elif p.name.endswith(".tmp") and st.st_mtime_ns < time.time_ns() - 3_600 * 10**9:
                p.unlink(missing_ok=True)
        entries.sort(reverse=True)
        for _, p in entries[MAX_ENTRIES:]:
            p.unlink(missing_ok=True)


_active: list[StringsCache] = []


def active() -> StringsCache | None:
    """The cache `$GENIE_STRINGS_CACHE_DIR` names (one object per folder), or None when unset."""
    folder = os.environ.get("GENIE_STRINGS_CACHE_DIR")  # = ENV
    if not folder:
        return None
    folder = os.path.normpath(folder)
    current = _active[0] if _active else None
    if current is not None and str(current.folder) == folder:
        return current
    cache = StringsCache(folder)
    _active[:] = [cache]
    return cache
