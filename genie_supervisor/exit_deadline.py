"""The hard bound on a shutdown: once a stop begins, the process is gone within ``api.shutdown_timeout_s``.

    deadline = ExitDeadline()
    deadline.arm(5.0)             # at SIGTERM (Supervisor.request_stop)
    ...                           # the graceful shutdown runs on the loop
    deadline.finish(rc)           # after anyio.run: wait (bounded) for worker threads, then exit

The graceful shutdown (``Supervisor._shutdown``) stops generations at their next step and drains
HTTP within the bound. What it cannot stop is a worker thread stuck in one long call: a prefill of
thousands of tokens in one chunk, a slow chat template, a hung read. anyio's worker threads are
not daemon threads, a ``to_thread.run_sync`` that is not abandoned on cancel keeps its task (and so
the task group) waiting, and the interpreter joins every non-daemon thread before it exits. So
when the deadline passes with the process still there, a daemon thread logs ``shutdown_forced``
with the threads still running (their names and the function each is in; never locals), flushes
the log and leaves with ``os._exit``. The MQTT broker publishes the retained ``offline`` will
when our socket closes, so Home Assistant sees the device go unavailable either way.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)


def stuck_threads() -> list[threading.Thread]:
    """Live non-daemon threads other than the main thread (what the interpreter would join at exit)."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def describe(thread: threading.Thread) -> str:
    """``name in module.function`` of where a thread is now (no arguments, no locals)."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return thread.name
    return f"{thread.name} in {frame.f_globals.get('__name__', '?')}.{frame.f_code.co_name}"


def flush_logs() -> None:
    """Flush every logging handler and the standard streams (nothing buffered is lost to os._exit)."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except (OSError, ValueError):  # a closed or full stream: nothing more to save
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class ExitDeadline:
    """Ends the process with `os._exit` when a stop takes longer than its bound."""

    def __init__(self, *, exit_fn: Callable[[int], object] = os._exit, exit_code: int = 0) -> None:
        """`exit_fn` is the way out (tests pass a recorder); `exit_code` what a forced exit returns:
        0, as a clean stop, because the requests were answered and the state was published."""
        self.exit_code = exit_code
        """Exit status of a forced exit."""
        self.deadline: float | None = None
        """Monotonic time by which the process is gone, once armed."""
        self.bound_s: float | None = None
        """The bound it was armed with."""
        self._exit_fn = exit_fn
        self._lock = threading.Lock()
        self._forced = False
        self._disarmed = threading.Event()

    def arm(self, seconds: float, reason: str = "stop") -> None:
        """Start the clock (the first call only): after `seconds` the process exits, done or not."""
        with self._lock:
            if self.deadline is not None:
                return
            self.deadline = time.monotonic() + seconds
            self.bound_s = seconds
        threading.Thread(target=self._watch, args=(reason,), name="exit-deadline", daemon=True).start()

    def disarm(self) -> None:
        """Stop the clock (tests; the daemon never takes a stop back)."""
        self._disarmed.set()

    def finish(self, rc: int, seconds: float) -> None:
        """The loop has ended: give worker threads until the deadline (armed now if it was not), then exit.

        The interpreter's own exit stays covered: the armed clock still ends a process that hangs after this."""
        self.exit_code = rc
        self.arm(seconds, reason="loop ended")
        assert self.deadline is not None
        for thread in stuck_threads():
            thread.join(max(0.0, self.deadline - time.monotonic()))
        if stuck_threads():
            self.force(rc)

    def _watch(self, reason: str) -> None:
        assert self.deadline is not None
        if not self._disarmed.wait(max(0.0, self.deadline - time.monotonic())):
            self.force(self.exit_code, reason=reason)

    def force(self, rc: int, reason: str = "stop") -> None:
        """Log what is still running, flush the log and leave now (once)."""
        with self._lock:
            if self._forced:
                return
            self._forced = True
        left = stuck_threads()
        log.warning(
            "shutdown_forced",
            reason=reason,
            bound_s=self.bound_s,
            threads=[describe(t) for t in left],
            action="exiting without waiting for the worker threads still running (api.shutdown_timeout_s)",
        )
        flush_logs()
        self._exit_fn(rc)
