"""systemd ``Type=notify`` support without depending on systemd (the sd_notify protocol by hand).

    notifier = Notifier.from_env(os.environ)      # inactive when NOTIFY_SOCKET is unset
    await tg.start(notifier.run_watchdog)         # WATCHDOG=1 every WATCHDOG_USEC / 2
    notifier.ready("serving on 127.0.0.1:8080")   # READY=1 once every component has started
    notifier.stopping()                           # STOPPING=1 when shutdown begins

A notification is one datagram of ``KEY=VALUE`` lines sent to the unix socket named by
``$NOTIFY_SOCKET`` (a name starting with ``@`` is in the abstract namespace). Sending never blocks
and never raises: a lost notification is logged, the daemon goes on.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Mapping

import anyio
import structlog
from anyio.abc import TaskStatus

log = structlog.get_logger(__name__)


def watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Half of ``$WATCHDOG_USEC`` in seconds, None when no watchdog is asked for this process."""
    usec = environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid and pid.strip() != str(os.getpid()):
        return None  # the watchdog belongs to another process (e.g. our parent)
    try:
        value = int(usec)
    except ValueError:
        log.warning("systemd_watchdog_ignored", reason=f"WATCHDOG_USEC is not an integer: {usec!r}")
        return None
    return value / 2_000_000 if value > 0 else None


class Notifier:
    """Sends sd_notify messages to one socket; every method is a no-op when inactive."""

    def __init__(self, socket_path: str | None, *, watchdog_s: float | None = None) -> None:
        self.socket_path = socket_path or None
        """The notify socket (``@name`` for an abstract one), None when not run by systemd."""
        self.watchdog_s = watchdog_s if self.socket_path else None
        """Seconds between WATCHDOG=1 pings, None for no pings."""
        self.sent: deque[str] = deque(maxlen=64)
        """The last messages sent, in order (for /status and tests)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, notify: bool = True, watchdog: bool = True) -> Notifier:
        """From ``$NOTIFY_SOCKET`` / ``$WATCHDOG_USEC``; `notify` / `watchdog` are the config switches."""
        path = environ.get("NOTIFY_SOCKET") if notify else None
        return cls(path, watchdog_s=watchdog_interval(environ) if watchdog else None)

    @property
    def active(self) -> bool:
        """True when there is a socket to notify."""
        return self.socket_path is not None

    def notify(self, *lines: str) -> bool:
        """Send ``lines`` as one datagram; True if it was sent."""
        if self.socket_path is None or not lines:
            return False
        message = "\n".join(lines)
        address = self.socket_path
        if address.startswith("@"):
            address = "\0" + address[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto(message.encode("utf-8"), address)
        except OSError as exc:
            log.warning("systemd_notify_failed", socket=self.socket_path, message=message, error=str(exc))
            return False
        self.sent.append(message)
        return True

    def ready(self, status: str | None = None) -> bool:
        """READY=1 (with a STATUS= line): every component has started."""
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """A free-text STATUS= line (``systemctl status`` shows it)."""
        return self.notify(f"STATUS={text}")

    def stopping(self, status: str = "stopping") -> bool:
        """STOPPING=1: shutdown has begun."""
        return self.notify("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        """One WATCHDOG=1 ping."""
        return self.notify("WATCHDOG=1")

    async def run_watchdog(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Ping every `watchdog_s` from the event loop (a stalled loop stops the pings); forever."""
        task_status.started()
        if self.watchdog_s is None:
            return
        log.info("systemd_watchdog", interval_s=self.watchdog_s)
        while True:
            self.watchdog()
            await anyio.sleep(self.watchdog_s)
