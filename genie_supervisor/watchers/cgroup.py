"""Memory and CPU of a cgroup v2 directory, found directly or from a container name.

Without asking Docker: a container's cgroup is one of ``docker-<id>.scope`` (systemd driver),
``docker/<id>`` (cgroupfs driver) or ``libpod-<id>.scope`` (Podman) somewhere under the cgroup
root. `find_container_cgroup` takes the first of those directories where

1. the container id starts with the given name (give an id prefix of 12+ characters), or
2. a process in it has ``HOSTNAME=<name>`` in ``/proc/<pid>/environ`` (``--hostname`` /
   compose ``hostname:``; needs the right to read that process's environment), or
3. a process in it has the name as a word of its command line (Home Assistant's container runs
   ``python3 -m homeassistant --config /config``, so ``homeassistant`` finds it).

Both roots are injectable, so tests run against a fake tree in the kernel's file format.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from .base import ProbeResult

MIB = 1024 * 1024
_CONTAINER_DIR = re.compile(r"^(?:docker-|libpod-)?([0-9a-f]{12,64})(?:\.scope)?$")


@dataclass(frozen=True)
class CgroupMemory:
    """One reading of a cgroup's memory files."""

    current_bytes: int
    """``memory.current``: everything charged to the cgroup, page cache included."""
    anon_bytes: int | None
    """``anon`` from ``memory.stat``: memory that cannot be dropped without swapping."""
    file_bytes: int | None
    """``file`` from ``memory.stat``: page cache."""
    inactive_file_bytes: int | None
    """``inactive_file`` from ``memory.stat``: cache the kernel would reclaim first."""

    @property
    def working_set_bytes(self) -> int:
        """``current - inactive_file``, what ``docker stats`` shows as usage."""
        return max(self.current_bytes - (self.inactive_file_bytes or 0), 0)


def read_memory(directory: str | Path) -> CgroupMemory:
    """Read ``memory.current`` and ``memory.stat``; OSError when the cgroup is gone."""
    directory = Path(directory)
    current = int((directory / "memory.current").read_text().strip())
    stat: dict[str, int] = {}
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                stat[key] = int(value)
    except OSError:
        pass
    return CgroupMemory(current, stat.get("anon"), stat.get("file"), stat.get("inactive_file"))


def read_cpu_usec(directory: str | Path) -> int | None:
    """``usage_usec`` from ``cpu.stat`` (None when the cpu controller is not enabled there)."""
    try:
        for line in (Path(directory) / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _container_dirs(cgroup_root: Path) -> list[Path]:
    found: list[Path] = []
    for pattern in ("*/docker-*.scope", "*/*/docker-*.scope", "docker/*", "*/libpod-*.scope", "*/*/libpod-*.scope"):
        found.extend(p for p in cgroup_root.glob(pattern) if p.is_dir() and _CONTAINER_DIR.match(p.name))
    return sorted(set(found))


def _procs(directory: Path) -> list[str]:
    try:
        return (directory / "cgroup.procs").read_text().split()
    except OSError:
        return []


def _read_nul_list(path: Path) -> list[str]:
    try:
        return [s for s in path.read_bytes().decode(errors="replace").split("\0") if s]
    except OSError:
        return []


def find_container_cgroup(
    container: str, cgroup_root: str | Path = "/sys/fs/cgroup", proc_root: str | Path = "/proc"
) -> Path | None:
    """The cgroup directory of a container, by id prefix, hostname or command line (see above)."""
    cgroup_root, proc_root = Path(cgroup_root), Path(proc_root)
    dirs = _container_dirs(cgroup_root)
    for directory in dirs:
        match = _CONTAINER_DIR.match(directory.name)
        if match and len(container) >= 12 and match.group(1).startswith(container):
            return directory
    word = re.compile(rf"(?:^|[\s/=]){re.escape(container)}(?:$|[\s/])")
    for directory in dirs:
        for pid in _procs(directory):
            if f"HOSTNAME={container}" in _read_nul_list(proc_root / pid / "environ"):
                return directory
            if word.search(" ".join(_read_nul_list(proc_root / pid / "cmdline"))):
                return directory
    return None


class CgroupProbe:
    """Memory (working set) and CPU % of a cgroup, given its directory or a container name."""

    source = "cgroup"

    def __init__(
        self,
        *,
        cgroup_path: str | Path | None = None,
        container: str | None = None,
        cgroup_root: str | Path = "/sys/fs/cgroup",
        proc_root: str | Path = "/proc",
    ) -> None:
        if (cgroup_path is None) == (container is None):
            raise ValueError("give exactly one of cgroup_path and container")
        self.cgroup_path = Path(cgroup_path) if cgroup_path is not None else None
        self.container = container
        self.cgroup_root = cgroup_root
        self.proc_root = proc_root
        self.restarts = 0
        self.last: CgroupMemory | None = None
        """The last memory reading."""
        self._resolved: Path | None = self.cgroup_path
        self._cpu: tuple[float, int] | None = None
        self._seen = False
        self._was_up = False

    async def probe(self) -> ProbeResult:
        """Read the cgroup files in a worker thread."""
        return await anyio.to_thread.run_sync(self.probe_sync)

    def probe_sync(self) -> ProbeResult:
        """Read now (blocking)."""
        what = str(self.cgroup_path) if self.cgroup_path else f"container {self.container}"
        if self._resolved is None or not self._resolved.is_dir():
            self._resolved = self.cgroup_path
            if self.container is not None:  # containers get a new cgroup on every restart
                self._resolved = find_container_cgroup(self.container, self.cgroup_root, self.proc_root)
        try:
            if self._resolved is None:
                raise FileNotFoundError(f"no cgroup found for {what}")
            memory = read_memory(self._resolved)
        except OSError as exc:
            self._resolved = self.cgroup_path
            self._cpu = None
            self._was_up = False
            up = False if self._seen else None
            return ProbeResult(up=up, reason=f"{what}: {exc}", restarts=self.restarts)

        if self._seen and not self._was_up:
            self.restarts += 1
        self._seen = self._was_up = True
        self.last = memory
        cpu_pct = None
        usage = read_cpu_usec(self._resolved)
        now = time.monotonic()
        if usage is not None:
            if self._cpu is not None and now > self._cpu[0]:
                cpu_pct = (usage - self._cpu[1]) / 1e4 / (now - self._cpu[0])
            self._cpu = (now, usage)
        return ProbeResult(
            up=True,
            reason=f"cgroup {self._resolved.name}",
            rss_mb=memory.working_set_bytes / MIB,
            cpu_pct=cpu_pct,
            restarts=self.restarts,
            pids=tuple(int(p) for p in _procs(self._resolved) if p.isdigit()),
        )
