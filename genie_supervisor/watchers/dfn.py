"""DeepFilterNet: count the underruns it logs ("Processing too slow") as ``dfn_underruns``.

Two sources, either or both:

- ``log_file``: read from where the file ended when the watcher started, on every probe
  (truncation or rotation to a smaller file restarts from its beginning);
- ``journal_unit``: a ``journalctl -f -u UNIT -o cat -n 0`` subprocess followed in the background
  (restarted with back-off when it exits; reported when journalctl is missing).

The process itself is watched by a `ProcessProbe` beside it (`build_watchers` adds both).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import anyio
import structlog
from anyio.abc import TaskStatus

from .base import ProbeResult

log = structlog.get_logger(__name__)

UNDERRUN_MARKER = "Processing too slow"
COUNTER = "dfn_underruns"


class UnderrunCounter:
    """Counts log lines containing `marker` in a file and/or a journal stream."""

    source = "dfn_log"

    def __init__(
        self,
        *,
        log_file: str | Path | None = None,
        journal_unit: str | None = None,
        journal_command: Sequence[str] | None = None,
        marker: str = UNDERRUN_MARKER,
        from_start: bool = False,
    ) -> None:
        if log_file is None and journal_unit is None and journal_command is None:
            raise ValueError("an underrun counter needs a log_file or a journal_unit")
        self.log_file = Path(log_file) if log_file is not None else None
        self.marker = marker.encode()
        self.count = 0
        """Underrun lines seen since start."""
        if journal_command is not None:
            self.journal_command: list[str] | None = list(journal_command)
        elif journal_unit is not None:
            self.journal_command = ["journalctl", "-f", "-u", journal_unit, "-o", "cat", "-n", "0"]
        else:
            self.journal_command = None
        self._offset: int | None = 0 if from_start else None
        self._partial = b""
        self._problem = ""

    # -- file -----------------------------------------------------------------------------------

    def read_file_sync(self) -> None:
        """Count underrun lines appended since the last call (blocking)."""
        assert self.log_file is not None
        try:
            size = self.log_file.stat().st_size
            if self._offset is None:
                self._offset = size  # start at the end: old lines are not news
            if size < self._offset:
                self._offset, self._partial = 0, b""
            with self.log_file.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError as exc:
            self._problem = f"log {self.log_file}: {exc.strerror or exc}"
            if self._offset is None:
                self._offset = 0  # a file created later is read from its beginning
            return
        self._problem = ""
        self._offset += len(data)
        self._count_lines(data)

    def _count_lines(self, data: bytes) -> None:
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        self.count += sum(self.marker in line for line in lines)

    # -- journal --------------------------------------------------------------------------------

    async def run_background(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow the journal (when configured) until cancelled; restarts it with back-off."""
        task_status.started()
        if self.journal_command is None:
            return
        delay = 1.0
        while True:
            if shutil.which(self.journal_command[0]) is None:
                self._problem = f"{self.journal_command[0]} not found"
                return
            try:
                async with await anyio.open_process(self.journal_command, stderr=None) as proc:
                    assert proc.stdout is not None
                    partial = b""
                    async for chunk in proc.stdout:
                        delay = 1.0
                        *lines, partial = (partial + chunk).split(b"\n")
                        self.count += sum(self.marker in line for line in lines)
                    code = await proc.wait()
                self._problem = f"journal follower exited with {code}"
            except OSError as exc:
                self._problem = f"journal follower: {exc}"
            log.warning("dfn_journal_restart", problem=self._problem, delay_s=delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, 60.0)

    # -- probe ----------------------------------------------------------------------------------

    async def probe(self) -> ProbeResult:
        """Read new file lines in a worker thread and report the count."""
        if self.log_file is not None:
            await anyio.to_thread.run_sync(self.read_file_sync)
        return ProbeResult(up=None, reason=self._problem, counters={COUNTER: self.count}, decides_up=False)
