"""Lines of a subprocess's stdout, read by a thread, awaited with a deadline (`Lines.wait_for`)."""

from __future__ import annotations

import queue
import subprocess
import threading
import time
from typing import Any


class Lines:
    """Reads a process's stdout in a thread so tests can wait for a log line with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert proc.stdout is not None
        self.thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _pump(self, stream: Any) -> None:
        """Queue every line of `stream` until it ends."""
        for line in stream:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float) -> str:
        """The first line not read yet that contains `text`; AssertionError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line with {text!r} within {timeout} s; got:\n" + "".join(self.seen[-30:]))
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append(line)
            if text in line:
                return line
