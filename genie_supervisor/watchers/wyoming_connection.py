"""One proxied Wyoming connection: its activity session, the relay both ways, and the `describe` probe.

`_Session` turns the event types seen on one connection into `VoiceActivity` starts and ends (STT:
`transcribe` / `audio-start` to `transcript`; TTS: `synthesize` to `audio-stop`, or a streaming
`synthesize-start` to `synthesize-stopped`). `_Connection` parses the client's bytes into events and
forwards the well-formed ones upstream (connecting on the first, holding `audio-stop` through the
proxy when asked), relays the server's bytes back while scanning them, closes after `idle_timeout_s`
without progress, and on an upstream drop asks `probe_wyoming` whether the server is down.
`WyomingProxy` (in `wyoming_proxy`) accepts connections and hands each to a `_Connection`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import structlog
from anyio.abc import SocketStream, TaskGroup

from genie_supervisor.events import VoiceActivity

from .wyoming_events import EventParser, EventScanner

if TYPE_CHECKING:
    from .wyoming_proxy import WyomingProxy

log = structlog.get_logger("genie_supervisor.watchers.wyoming_proxy")  # the proxy's log lines keep its logger name

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
