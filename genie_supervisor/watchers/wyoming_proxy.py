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
import anyio.lowlevel
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskGroup, TaskStatus

from genie_supervisor.events import ServiceObservation, VoiceActivity

from .base import Publish, WaitParked
from .wyoming_events import EventParser, EventScanner

__all__ = ["EventScanner", "ProxyStats", "WyomingProxy", "probe_wyoming"]

log = structlog.get_logger(__name__)

ServiceKind = Literal["stt", "tts"]

STT_START = frozenset({"transcribe", "audio-start"})
"""Client events that start an STT request."""
STT_END = frozenset({"transcript", "transcript-stop", "error"})
"""Server events that end an STT request."""
TTS_START = frozenset({"synthesize", "synthesize-start"})
"""Client events that start a TTS request."""
TTS_END_CLASSIC = frozenset({"audio-stop", "error"})
"""Server events that end a plain `synthesize` request."""
TTS_END_STREAMING = frozenset({"synthesize-stopped", "error"})
"""Server events that end a streaming (`synthesize-start`) request."""

_DESCRIBE = b'{"type": "describe"}\n'
_READ_SIZE = 65536
_SOCKET_ERRORS = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError)


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


class _UpstreamEnded(Exception):
    """The upstream connection ended (EOF or error); `clean` tells which."""

    def __init__(self, clean: bool, detail: str) -> None:
        super().__init__(detail)
        self.clean = clean
        self.detail = detail


class _Session:
    """Activity state of one proxied connection."""

    def __init__(self, proxy: WyomingProxy, session_id: str) -> None:
        self.proxy = proxy
        self.id = session_id
        self.active = False
        self.streaming = False

    def set_active(self, active: bool, event: str) -> None:
        if active == self.active:
            return
        self.active = active
        if not active:
            self.streaming = False
        self.proxy.publish(
            VoiceActivity(
                service=self.proxy.service,
                active=active,
                source=f"proxy:{self.proxy.name}",
                session=self.id,
                event=event,
            )
        )

    def from_client(self, event: str) -> None:
        if self.proxy.service == "stt":
            if event in STT_START or (event == "audio-stop" and not self.active):
                self.set_active(True, event)
        elif event in TTS_START:
            if event == "synthesize-start":
                self.streaming = True
            self.set_active(True, event)

    def from_server(self, event: str) -> None:
        if self.proxy.service == "stt":
            ends = STT_END
        else:
            ends = TTS_END_STREAMING if self.streaming else TTS_END_CLASSIC
        if event in ends:
            self.set_active(False, event)


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


class _Connection:
    """One client connection: parse and forward the client's events, relay the server's answer."""

    def __init__(self, proxy: WyomingProxy, client: SocketStream, session: _Session) -> None:
        self.proxy = proxy
        self.client = client
        self.session = session
        self.upstream: SocketStream | None = None
        self.ended: _UpstreamEnded | None = None
        self.end_event = "close"
        self.client_eof = False
        self.last_progress = time.monotonic()
        self._tg: TaskGroup | None = None

    def _stop(self, end_event: str | None = None) -> None:
        if end_event is not None and self.end_event == "close":
            self.end_event = end_event
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    async def run(self) -> str:
        """Relay until either side is done; returns the `event` that ends an active session."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._watchdog)
                tg.start_soon(self._client_to_upstream)
        finally:
            if self.upstream is not None:
                await self.upstream.aclose()
        end = self.ended
        # A clean close after the client's own EOF is the normal end of a request, even mid-session.
        if end is not None and (not end.clean or (self.session.active and not self.client_eof)):
            await self.client.aclose()  # the client need not wait for the probe
            await self._upstream_dropped(end)
        return self.end_event

    async def _upstream_dropped(self, end: _UpstreamEnded) -> None:
        """The upstream ended this connection mid-request: end the session, then ask whether the
        server is down or only dropped this connection (it may refuse one client's request)."""
        proxy = self.proxy
        proxy.stats.upstream_failures += 1
        what = "mid-request" if self.session.active else "idle"
        self.session.set_active(False, "upstream-closed")
        up, reason = await probe_wyoming(proxy.upstream_host, proxy.upstream_port, proxy.health_timeout_s)
        if up:
            log.warning(
                "wyoming_upstream_dropped_connection",
                proxy=proxy.name,
                session=self.session.id,
                detail=f"{end.detail} ({what})",
                probe=reason,
            )
            proxy._set_up(True, reason, always=False)
        else:
            proxy._set_up(False, f"{end.detail} ({what}); {reason}")

    async def _watchdog(self) -> None:
        """Close the connection once `idle_timeout_s` passes without progress on either side."""
        idle = self.proxy.idle_timeout_s
        while True:  # progress moves the deadline: sleep until the latest one has passed
            left = self.last_progress + idle - time.monotonic()
            if left <= 0:
                break
            await anyio.sleep(left)
        self.proxy.stats.idle_timeouts += 1
        log.info(
            "wyoming_client_idle_timeout",
            proxy=self.proxy.name,
            session=self.session.id,
            idle_timeout_s=idle,
            stt_active=self.session.active,
        )
        self._stop("idle-timeout")

    async def _connect(self) -> bool:
        proxy = self.proxy
        try:
            with anyio.fail_after(proxy.connect_timeout_s):
                self.upstream = await anyio.connect_tcp(proxy.upstream_host, proxy.upstream_port)
        except (OSError, TimeoutError) as exc:
            proxy.stats.upstream_failures += 1
            proxy._set_up(False, f"connect failed: {exc or 'timeout'}")
            return False
        proxy._set_up(True, "connected", always=False)
        assert self._tg is not None
        self._tg.start_soon(self._upstream_to_client)
        return True

    async def _client_to_upstream(self) -> None:
        parser = EventParser()
        proxy, session = self.proxy, self.session
        while True:
            try:
                chunk = await self.client.receive(_READ_SIZE)
            except anyio.EndOfStream:
                self.client_eof = True
                if parser.pending:
                    log.info(
                        "wyoming_client_truncated",
                        proxy=proxy.name,
                        session=session.id,
                        detail="closed mid-event; the partial event was not forwarded",
                    )
                if self.upstream is None:
                    self._stop()
                    return
                try:
                    await self.upstream.send_eof()
                except _SOCKET_ERRORS:
                    pass
                return  # keep relaying the answer until the server closes
            except _SOCKET_ERRORS:
                self._stop()
                return
            events = parser.feed(chunk)
            out = bytearray()
            for event in events:
                self.last_progress = time.monotonic()
                session.from_client(event.type)  # before the upstream connect: the pause starts now
                if self.upstream is None and not await self._connect():
                    self._stop()
                    return
                if event.type == "audio-stop" and proxy.hold_audio_stop:
                    await self._send_upstream(bytes(out))
                    out.clear()
                    await proxy._hold()
                out += event.raw
            await self._send_upstream(bytes(out))
            if parser.error is not None:
                proxy.stats.bad_input += 1
                log.warning(
                    "wyoming_client_bad_input",
                    proxy=proxy.name,
                    session=session.id,
                    error=parser.error,
                    stt_active=session.active,
                )
                self._stop("bad-input")
                return

    async def _send_upstream(self, data: bytes) -> None:
        if not data:
            return
        assert self.upstream is not None
        try:
            await self.upstream.send(data)
        except _SOCKET_ERRORS as exc:
            self.ended = _UpstreamEnded(False, f"upstream send failed: {exc!r}")
            self._stop()
            await anyio.lowlevel.checkpoint()

    async def _upstream_to_client(self) -> None:
        assert self.upstream is not None
        scanner = EventScanner()
        while True:
            try:
                chunk = await self.upstream.receive(_READ_SIZE)
            except anyio.EndOfStream:
                self.ended = _UpstreamEnded(True, "upstream closed")
                break
            except _SOCKET_ERRORS as exc:
                self.ended = _UpstreamEnded(False, f"upstream error: {exc!r}")
                break
            self.last_progress = time.monotonic()
            for _, event in scanner.feed(chunk):
                self.session.from_server(event)
            try:
                await self.client.send(chunk)
            except _SOCKET_ERRORS:
                break
        self._stop()


async def probe_wyoming(host: str, port: int, timeout_s: float = 1.0) -> tuple[bool, str]:
    """Ask a Wyoming server to `describe` itself; up when `info` arrives within `timeout_s`."""
    started = time.perf_counter()
    try:
        with anyio.fail_after(timeout_s):
            async with await anyio.connect_tcp(host, port) as stream:
                await stream.send(_DESCRIBE)
                scanner = EventScanner()
                while True:
                    chunk = await stream.receive(_READ_SIZE)
                    if any(event == "info" for _, event in scanner.feed(chunk)):
                        ms = (time.perf_counter() - started) * 1000
                        log.debug("wyoming_info", host=host, port=port, ms=round(ms, 2))
                        return True, "describe ok"
                    if scanner.broken:
                        return False, "not a Wyoming server"
    except TimeoutError:
        return False, f"no info within {timeout_s}s"
    except anyio.EndOfStream:
        return False, "closed before info"
    except (OSError, anyio.BrokenResourceError) as exc:
        return False, f"connect failed: {exc}"
