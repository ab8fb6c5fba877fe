"""What every telemetry source offers, and the loop that samples one without blocking the event loop."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import anyio
import anyio.to_thread
import structlog
from anyio.abc import TaskStatus

from genie_supervisor.errors import TelemetryError as TelemetryError  # re-export
from genie_supervisor.errors import TelemetryUnavailable as TelemetryUnavailable  # re-export
from genie_supervisor.events import TelemetrySample

log = structlog.get_logger(__name__)

Publish = Callable[[TelemetrySample], "Awaitable[None] | None"]
"""Where samples go: a plain function, or a coroutine function the sampler awaits."""


@runtime_checkable
class TelemetrySource(Protocol):
    """A platform's sensors, read synchronously; the sampler moves the reads to a worker thread."""

    name: str
    """Short identifier used in logs (e.g. ``jetson``, ``jetson-tegrastats``, ``nvml``)."""

    def probe(self) -> str | None:
        """None when this source works here, otherwise the reason it does not (one line)."""
        ...

    def sample(self) -> TelemetrySample:
        """Read every sensor once; blocking but cheap. Raises TelemetryError when nothing could be read."""
        ...

    def close(self) -> None:
        """Release handles, subprocesses and libraries; safe to call twice."""
        ...


async def run_sampler(
    source: TelemetrySource,
    publish: Publish,
    interval_s: float,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    sample_timeout_s: float = 5.0,
    max_backoff_s: float = 60.0,
) -> None:
    """Sample `source` every `interval_s` seconds and hand each sample to `publish`, forever.

    `sample()` runs in a worker thread with a deadline, so a slow sysfs read or a hung
    subprocess never stalls the loop. A failure (an exception from the source or from
    `publish`, or the deadline passing) is logged and retried with exponential back-off capped
    at `max_backoff_s`; the next good sample resets it. Readiness is announced after the first
    attempt: the first published sample normally, or the first failure, so a broken sensor
    degrades telemetry instead of holding the whole daemon's start-up. A sample() that overran
    its deadline is never run twice at once: until it returns, attempts count as failures, so a
    hung sensor cannot eat the worker threads.
    Cancellation stops the loop; the caller owns `source` and closes it.
    """
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    started = False
    failures = 0
    in_flight = threading.Event()  # set while a sample() thread runs, even one we stopped waiting for

    def sample_in_thread() -> TelemetrySample:
        in_flight.set()
        try:
            return source.sample()
        finally:
            in_flight.clear()

    while True:
        try:
            if in_flight.is_set():
                raise TelemetryError("the previous sample() is still running")
            with anyio.fail_after(sample_timeout_s):
                sample = await anyio.to_thread.run_sync(sample_in_thread, abandon_on_cancel=True)
            result = publish(sample)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # cancellation is a BaseException and passes through
            failures += 1
            delay = min(interval_s * 2 ** min(failures, 16), max_backoff_s)
            log.warning(
                "telemetry_sample_failed",
                source=source.name,
                error=_describe(exc, sample_timeout_s),
                failures=failures,
                retry_in_s=round(delay, 3),
            )
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(delay)
            continue
        if failures:
            log.info("telemetry_sample_recovered", source=source.name, after_failures=failures)
            failures = 0
        if not started:
            started = True
            task_status.started()
        await anyio.sleep(interval_s)


def _describe(exc: Exception, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"sample() took longer than {timeout_s} s"
    return f"{type(exc).__name__}: {exc}"
