"""A Wyoming proxy that knows, to the event, when STT or TTS runs.

Home Assistant opens one TCP connection per STT/TTS request. Put this proxy between Home Assistant
and the real server (wyoming-faster-whisper, wyoming-piper). What the client sends is parsed into
events and each complete, well-formed event is forwarded unchanged (its bytes exactly as received);
a malformed one closes that client's connection, so the upstream never sees a malformed event from
the proxy. What the server sends back is forwarded byte for byte while a copy is scanned for event
types. From those events it publishes `VoiceActivity` (one session per connection) and the
upstream's health as `ServiceObservation`.

Each connection is bounded: `idle_timeout_s` without a complete event from the client and without
bytes from the server closes it (a trickled partial header included), and at most
`max_connections` are open at once (more get a Wyoming `error` event and are closed). The
upstream is connected only once the client's first well-formed event has arrived.

Optionally it holds `audio-stop` -- the moment batch STT starts its heavy work -- until the LLM
engine reports parked (bounded by `hold_max_s`).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import time
from dataclasses import dataclass
from typing import Literal

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from genie_supervisor.events import ServiceObservation

from .base import Publish, WaitParked
from .wyoming_connection import _SOCKET_ERRORS, _Connection, _Session, probe_wyoming
from .wyoming_events import EventScanner

__all__ = ["EventScanner", "ProxyStats", "WyomingProxy", "probe_wyoming"]

log = structlog.get_logger(__name__)

ServiceKind = Literal["stt", "tts"]


def _error_event(text: str, code: str) -> bytes:
    """A Wyoming `error` event as bytes (what `wyoming.error.Error` writes)."""
    data = json.dumps({"text": text, "code": code}).encode()
    return json.dumps({"type": "error", "data_length": len(data)}).encode() + b"\n" + data


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (``localhost`` counts)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ProxyStats:
    """Counters of one proxy since it started."""

    connections: int = 0
    """Client connections accepted."""
    upstream_failures: int = 0
    """Connections where the upstream could not be reached or died mid-request."""
    holds: int = 0
    """`audio-stop` events held for the engine to park."""
    hold_timeouts: int = 0
    """Holds that ended because `hold_max_s` passed before the engine parked."""
    last_hold_ms: float | None = None
    """How long the last hold took."""
    bad_input: int = 0
    """Client connections closed because they sent something that is not a well-formed event."""
    idle_timeouts: int = 0
    """Client connections closed after `idle_timeout_s` without progress."""
    refused: int = 0
    """Client connections refused because `max_connections` were open."""


class WyomingProxy:
    """Listens on `listen_host:listen_port`, forwards each connection's events to the upstream."""

    def __init__(
        self,
        name: str,
        listen_host: str,
        listen_port: int,
        upstream_host: str,
        upstream_port: int,
        service: ServiceKind,
        publish: Publish,
        wait_parked: WaitParked | None = None,
        hold_audio_stop_until_parked: bool = True,
        hold_max_s: float = 0.5,
        *,
        health_interval_s: float | None = 5.0,
        health_timeout_s: float = 1.0,
        connect_timeout_s: float = 2.0,
        idle_timeout_s: float = 90.0,
        max_connections: int = 32,
    ) -> None:
        if service not in ("stt", "tts"):
            raise ValueError(f"service must be 'stt' or 'tts', got {service!r}")
        if idle_timeout_s <= 0 or max_connections < 1:
            raise ValueError("idle_timeout_s must be > 0 and max_connections >= 1")
        self.name = name
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.service: ServiceKind = service
        self.publish = publish
        self.wait_parked = wait_parked
        self.hold_audio_stop = hold_audio_stop_until_parked and service == "stt"
        self.hold_max_s = hold_max_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.stats = ProxyStats()
        self.port: int | None = None
        """The port actually bound (set once `serve` is ready)."""
        self.up: bool | None = None
        """Upstream state as last published."""
        self.open_connections = 0
        """Client connections open now."""
        self._restarts = 0
        self._ids = itertools.count(1)

    # -- health ---------------------------------------------------------------------------------

    def _set_up(self, up: bool, reason: str, *, always: bool = True) -> None:
        if up and self.up is False:
            self._restarts += 1
        changed = up != self.up
        self.up = up
        if changed:
            log.info("wyoming_upstream", proxy=self.name, up=up, reason=reason)
        if changed or always:
            self.publish(
                ServiceObservation(
                    service=self.name,
                    up=up,
                    reason=reason,
                    restarts=self._restarts,
                    counters={
                        "connections": self.stats.connections,
                        "upstream_failures": self.stats.upstream_failures,
                        "hold_timeouts": self.stats.hold_timeouts,
                        "bad_input": self.stats.bad_input,
                        "idle_timeouts": self.stats.idle_timeouts,
                        "refused": self.stats.refused,
                    },
                )
            )

    async def check_health(self) -> tuple[bool, str]:
        """Send `describe` upstream and expect `info` within `health_timeout_s`; publish the result."""
        up, reason = await probe_wyoming(self.upstream_host, self.upstream_port, self.health_timeout_s)
        self._set_up(up, reason)
        return up, reason

    async def _health_loop(self) -> None:
        assert self.health_interval_s is not None
        while True:
            await self.check_health()
            await anyio.sleep(self.health_interval_s)

    # -- serving --------------------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, report the bound port through `task_status`, and proxy until cancelled."""
        listener = await anyio.create_tcp_listener(local_host=self.listen_host, local_port=self.listen_port)
        async with listener, anyio.create_task_group() as tg:
            self.port = int(listener.listeners[0].extra(SocketAttribute.local_port))
            log.info(
                "wyoming_proxy_listening",
                proxy=self.name,
                listen=f"{self.listen_host}:{self.port}",
                loopback_only=is_loopback(self.listen_host),
                upstream=f"{self.upstream_host}:{self.upstream_port}",
                idle_timeout_s=self.idle_timeout_s,
                max_connections=self.max_connections,
            )
            if self.health_interval_s is not None:
                tg.start_soon(self._health_loop)
            task_status.started(self.port)
            await listener.serve(self._handle, task_group=tg)

    run = serve

    async def _handle(self, client: SocketStream) -> None:
        if self.open_connections >= self.max_connections:
            self.stats.refused += 1
            log.warning(
                "wyoming_proxy_refused",
                proxy=self.name,
                open=self.open_connections,
                max_connections=self.max_connections,
            )
            async with client:
                with anyio.move_on_after(1.0):
                    try:
                        await client.send(
                            _error_event(f"too many connections (max_connections {self.max_connections})", "busy")
                        )
                    except _SOCKET_ERRORS:
                        pass
            return
        self.open_connections += 1
        self.stats.connections += 1
        session = _Session(self, f"{self.name}:{next(self._ids)}")
        end_event = "close"
        try:
            async with client:
                end_event = await _Connection(self, client, session).run()
        except Exception as exc:  # one broken connection must not stop the proxy
            log.warning("wyoming_proxy_connection_failed", proxy=self.name, error=repr(exc))
        finally:
            self.open_connections -= 1
            session.set_active(False, end_event)

    async def _hold(self) -> None:
        """Wait (bounded) for the engine to park before `audio-stop` goes upstream."""
        if self.wait_parked is None:
            return
        self.stats.holds += 1
        started = time.perf_counter()
        parked = False
        with anyio.move_on_after(self.hold_max_s + 0.05):
            parked = await self.wait_parked(self.hold_max_s)
        if not parked:
            self.stats.hold_timeouts += 1
        self.stats.last_hold_ms = (time.perf_counter() - started) * 1000
        log.debug("audio_stop_held", proxy=self.name, parked=parked, ms=self.stats.last_hold_ms)
