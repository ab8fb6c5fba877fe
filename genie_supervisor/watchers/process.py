"""Find a service's processes and measure them: up/down, RSS, CPU %, restarts, GPU memory.

A service is found by any of four selectors; the processes are the union of what each configured
selector finds (normally one is enough):

- ``systemd_unit``: the pids in ``<cgroup_root>/system.slice/<unit>/cgroup.procs`` (and sub-cgroups);
- ``process_name``: psutil's ``name()`` or the basename of ``argv[0]`` equals it;
- ``cmdline_pattern``: a regular expression searched in the space-joined command line;
- ``pid_file``: the pid written in that file, when that process exists.

psutil scans block, so `ProcessProbe.probe` runs them in a worker thread.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import psutil

from .base import ProbeResult

MIB = 1024 * 1024

GpuMemory = Callable[[Sequence[int]], "float | None"]
"""Given pids, the GPU memory they hold in MiB (None where the platform does not say); blocking."""


@dataclass(frozen=True)
class ProcessSelector:
    """How to recognise a service's processes (any of the fields; the matches are united)."""

    systemd_unit: str | None = None
    """systemd unit (``wyoming-piper`` or ``wyoming-piper.service``)."""
    process_name: str | None = None
    """Executable name as psutil reports it, or the basename of argv[0]."""
    cmdline_pattern: str | None = None
    """Regular expression searched in the command line joined by spaces."""
    pid_file: str | None = None
    """File holding the main pid."""
    cgroup_root: str = "/sys/fs/cgroup"
    """Root of the cgroup v2 hierarchy (injectable for tests)."""

    def configured(self) -> bool:
        """Whether any selector is set."""
        return any((self.systemd_unit, self.process_name, self.cmdline_pattern, self.pid_file))

    def describe(self) -> str:
        """The selectors in words, for reasons and logs."""
        parts = []
        if self.systemd_unit:
            parts.append(f"unit {self.systemd_unit}")
        if self.process_name:
            parts.append(f"name {self.process_name}")
        if self.cmdline_pattern:
            parts.append(f"cmdline ~ {self.cmdline_pattern!r}")
        if self.pid_file:
            parts.append(f"pid file {self.pid_file}")
        return ", ".join(parts) or "no selector"


def unit_cgroup(unit: str, cgroup_root: str | Path = "/sys/fs/cgroup") -> Path:
    """The cgroup directory systemd gives a system unit."""
    if "." not in unit:
        unit += ".service"
    return Path(cgroup_root) / "system.slice" / unit


def cgroup_pids(directory: Path) -> set[int]:
    """Pids in a cgroup v2 directory and its sub-cgroups (empty when it does not exist)."""
    pids: set[int] = set()
    if not directory.is_dir():
        return pids
    for procs in [directory / "cgroup.procs", *directory.rglob("*/cgroup.procs")]:
        try:
            text = procs.read_text()
        except OSError:
            continue
        pids.update(int(line) for line in text.split() if line.isdigit())
    return pids


def read_pid_file(path: str | Path) -> int | None:
    """The pid in a pid file, or None when it is missing or unreadable."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def find_pids(selector: ProcessSelector) -> set[int]:
    """Pids of live processes matching the selector (never this process). Blocking."""
    pids: set[int] = set()
    if selector.systemd_unit:
        pids |= cgroup_pids(unit_cgroup(selector.systemd_unit, selector.cgroup_root))
    if selector.pid_file:
        pid = read_pid_file(selector.pid_file)
        if pid is not None and psutil.pid_exists(pid):
            pids.add(pid)
    if selector.process_name or selector.cmdline_pattern:
        pattern = re.compile(selector.cmdline_pattern) if selector.cmdline_pattern else None
        for proc in psutil.process_iter(["name", "cmdline"]):
            name = proc.info["name"] or ""
            cmdline = proc.info["cmdline"] or []
            if selector.process_name and selector.process_name in (
                name,
                os.path.basename(cmdline[0]) if cmdline else "",
            ):
                pids.add(proc.pid)
            elif pattern is not None and pattern.search(" ".join(cmdline)):
                pids.add(proc.pid)
    pids.discard(os.getpid())
    return {pid for pid in pids if _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ProcessProbe:
    """Looks for a service's processes each time it is asked; counts restarts across calls."""

    source = "process"

    def __init__(self, selector: ProcessSelector, gpu_memory: GpuMemory | None = None) -> None:
        if not selector.configured():
            raise ValueError("a process probe needs one of systemd_unit, process_name, cmdline_pattern or pid_file")
        self.selector = selector
        self.gpu_memory = gpu_memory
        self.restarts = 0
        self._procs: dict[int, psutil.Process] = {}
        self._seen = False
        self._was_up = False

    async def probe(self) -> ProbeResult:
        """Scan in a worker thread and report."""
        return await anyio.to_thread.run_sync(self.probe_sync)

    def probe_sync(self) -> ProbeResult:
        """Scan now (blocking)."""
        pids = find_pids(self.selector)
        if not pids:
            self._procs.clear()
            self._was_up = False
            if not self._seen:
                return ProbeResult(up=None, reason=f"never found ({self.selector.describe()})", restarts=self.restarts)
            return ProbeResult(
                up=False, reason=f"process not found ({self.selector.describe()})", restarts=self.restarts
            )

        previous = set(self._procs)
        if self._seen and (not self._was_up or (previous and not previous & pids)):
            self.restarts += 1  # back after being down, or replaced between two scans
        self._seen = True
        self._was_up = True

        rss = 0
        cpu: float | None = None
        for pid in sorted(pids):
            proc = self._procs.get(pid)
            fresh = proc is None
            try:
                if proc is None:
                    proc = psutil.Process(pid)
                    self._procs[pid] = proc
                with proc.oneshot():
                    rss += proc.memory_info().rss
                    pct = proc.cpu_percent(interval=None)
            except psutil.Error:
                self._procs.pop(pid, None)
                continue
            if not fresh:  # the first cpu_percent() of a process has no reference yet
                cpu = (cpu or 0.0) + pct
        for gone in set(self._procs) - pids:
            del self._procs[gone]

        gpu = self.gpu_memory(sorted(pids)) if self.gpu_memory is not None else None
        count = len(pids)
        return ProbeResult(
            up=True,
            reason=f"{count} process{'es' if count > 1 else ''}",
            rss_mb=rss / MIB,
            cpu_pct=cpu,
            gpu_mem_mb=gpu,
            restarts=self.restarts,
            pids=tuple(sorted(pids)),
        )
