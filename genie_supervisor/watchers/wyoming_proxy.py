"""A byte-transparent Wyoming proxy that knows, to the event, when STT or TTS runs.

Home Assistant opens one TCP connection per STT/TTS request. Put this proxy between Home Assistant
and the real server (wyoming-faster-whisper, wyoming-piper): every byte is forwarded unchanged in
both directions, while a copy of each stream is scanned for event headers (a JSON line, then
``data_length`` bytes of data, then ``payload_length`` bytes of payload). From those events it
publishes `VoiceActivity` (one session per connection) and the upstream's health as
`ServiceObservation`.

Optionally it holds `audio-stop` -- the moment batch STT starts its heavy work -- until the LLM
engine reports parked (bounded by `hold_max_s`).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from typing import Literal

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream, TaskStatus

from genie_supervisor.events import ServiceObservation, VoiceActivity

from .base import Publish, WaitParked

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
_MAX_HEADER = 1 << 20
_READ_SIZE = 65536


class EventScanner:
    """Follows one direction of a Wyoming byte stream and finds where each event header ends.

    `feed` takes bytes as they arrive and returns ``(index, type)`` for every header line that
    ends in them, ``index`` being the position of its newline in the chunk. Data and payload bytes
    are skipped without copying. A stream that is not Wyoming sets `broken` and is no longer scanned
    (forwarding goes on regardless).
    """

    def __init__(self) -> None:
        self._header = bytearray()
        self._skip = 0
        self.broken = False

    def feed(self, chunk: bytes) -> list[tuple[int, str]]:
        found: list[tuple[int, str]] = []
        pos, end = 0, len(chunk)
        while pos < end and not self.broken:
            if self._skip:
                step = min(self._skip, end - pos)
                self._skip -= step
                pos += step
                continue
            newline = chunk.find(b"\n", pos)
            if newline < 0:
                self._header += chunk[pos:]
                self.broken = len(self._header) > _MAX_HEADER
                break
            self._header += chunk[pos:newline]
            pos = newline + 1
            line = bytes(self._header)
            self._header.clear()
            if not line.strip():
                continue
            try:
                header = json.loads(line)
                event_type = str(header["type"])
                data_length = int(header.get("data_length") or 0)
                payload_length = int(header.get("payload_length") or 0)
            except (ValueError, KeyError, TypeError):
                self.broken = True
                break
            self._skip = max(data_length, 0) + max(payload_length, 0)
            found.append((newline, event_type))
        return found


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
    """Listens on `listen_port`, forwards each connection byte-for-byte to the upstream server."""

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
    ) -> None:
        if service not in ("stt", "tts"):
            raise ValueError(f"service must be 'stt' or 'tts', got {service!r}")
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
        self.stats = ProxyStats()
        self.port: int | None = None
        """The port actually bound (set once `serve` is ready)."""
        self.up: bool | None = None
        """Upstream state as last published."""
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
                    },
                )
            )

    async def check_health(self) -> tuple[bool, str]:
        """Send `describe` upstream and expect `info` within `health_timeout_s`; publish the result."""
        up, reason = await probe_wyoming(
            self.upstream_host, self.upstream_port, self.health_timeout_s
        )
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
        listener = await anyio.create_tcp_listener(
            local_host=self.listen_host, local_port=self.listen_port
        )
        async with listener, anyio.create_task_group() as tg:
            self.port = int(listener.listeners[0].extra(SocketAttribute.local_port))
            log.info(
                "wyoming_proxy_listening",
                proxy=self.name,
                port=self.port,
                upstream=f"{self.upstream_host}:{self.upstream_port}",
            )
            if self.health_interval_s is not None:
                tg.start_soon(self._health_loop)
            task_status.started(self.port)
            await listener.serve(self._handle, task_group=tg)

    run = serve

    async def _handle(self, client: SocketStream) -> None:
        self.stats.connections += 1
        session = _Session(self, f"{self.name}:{next(self._ids)}")
        try:
            async with client:
                try:
                    with anyio.fail_after(self.connect_timeout_s):
                        upstream = await anyio.connect_tcp(self.upstream_host, self.upstream_port)
                except (OSError, TimeoutError) as exc:
                    self.stats.upstream_failures += 1
                    self._set_up(False, f"connect failed: {exc or 'timeout'}")
                    return
                self._set_up(True, "connected", always=False)
                async with upstream:
                    await self._relay(client, upstream, session)
        except Exception as exc:  # one broken connection must not stop the proxy
            log.warning("wyoming_proxy_connection_failed", proxy=self.name, error=repr(exc))
        finally:
            session.set_active(False, "close")

    async def _relay(self, client: SocketStream, upstream: SocketStream, session: _Session) -> None:
        ended: list[_UpstreamEnded] = []

        async def client_to_upstream() -> None:
            scanner = EventScanner()
            while True:
                try:
                    chunk = await client.receive(_READ_SIZE)
                except anyio.EndOfStream:
                    try:
                        await upstream.send_eof()
                    except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass
                    return  # keep relaying the answer until the server closes
                except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    tg.cancel_scope.cancel()
                    return
                start = 0
                for newline, event in scanner.feed(chunk):
                    session.from_client(event)
                    if event == "audio-stop" and self.hold_audio_stop:
                        await self._send_upstream(upstream, chunk[start:newline])
                        start = newline
                        await self._hold()
                await self._send_upstream(upstream, chunk[start:])

        async def upstream_to_client() -> None:
            scanner = EventScanner()
            while True:
                try:
                    chunk = await upstream.receive(_READ_SIZE)
                except anyio.EndOfStream:
                    raise _UpstreamEnded(True, "upstream closed") from None
                except (OSError, anyio.BrokenResourceError) as exc:
                    raise _UpstreamEnded(False, f"upstream error: {exc!r}") from None
                for _, event in scanner.feed(chunk):
                    session.from_server(event)
                try:
                    await client.send(chunk)
                except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    tg.cancel_scope.cancel()
                    return

        async def run_down() -> None:
            try:
                await upstream_to_client()
            except _UpstreamEnded as end:
                ended.append(end)
            tg.cancel_scope.cancel()

        async def run_up() -> None:
            try:
                await client_to_upstream()
            except _UpstreamEnded as end:
                ended.append(end)
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_down)
            tg.start_soon(run_up)

        if ended:
            end = ended[0]
            if session.active or not end.clean:
                self.stats.upstream_failures += 1
                what = "mid-request" if session.active else "idle"
                self._set_up(False, f"{end.detail} ({what})")

    async def _send_upstream(self, upstream: SocketStream, data: bytes) -> None:
        if not data:
            return
        try:
            await upstream.send(data)
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise _UpstreamEnded(False, f"upstream send failed: {exc!r}") from None

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
