"""The Wyoming proxy against bad clients: garbage, lies about lengths, stalls and floods.

The upstream is a real `wyoming` server that checks every event it reads: anything it cannot parse
(or a truncated event) is recorded in `StrictServer.malformed`, which must stay empty -- the proxy
forwards only complete, well-formed events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from wyoming.asr import Transcript
from wyoming.audio import AudioChunk, AudioStart
from wyoming.event import async_read_event

from genie_supervisor.config import ServiceConfig
from genie_supervisor.events import ServiceObservation, VoiceActivity
from genie_supervisor.watchers import WyomingProxy, build_watchers
from genie_supervisor.watchers.wyoming_events import (
    MAX_DATA_BYTES,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD_BYTES,
    EventParser,
)
from tests.test_wyoming_proxy import (
    CHANNELS,
    HOST,
    RATE,
    WIDTH,
    FakeServer,
    Log,
    _Handler,
    client_exchange,
    encode,
    free_port,
    stt_request,
)


class _Tap:
    """Wraps the server's StreamReader and remembers the last header line read."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.last_line: bytes | None = None

    async def readline(self) -> bytes:
        self.last_line = None
        self.last_line = await self.reader.readline()
        return self.last_line

    async def readexactly(self, n: int) -> bytes:
        return await self.reader.readexactly(n)


class _StrictHandler(_Handler):
    """The tests' fake whisper, reading with `wyoming`'s own parser and recording what fails."""

    async def run(self) -> None:
        srv = self.server
        assert isinstance(srv, StrictServer)
        tap = _Tap(self.reader)
        try:
            while True:
                try:
                    event = await async_read_event(tap)  # type: ignore[arg-type]
                except asyncio.IncompleteReadError as exc:
                    srv.malformed.append(f"truncated event ({len(exc.partial)} of {exc.expected})")
                    break
                if event is None:
                    if tap.last_line != b"":  # not the end of the stream: a line it could not parse
                        srv.malformed.append(f"unparsable header {tap.last_line!r:.200}")
                    break
                if not isinstance(event.type, str) or not isinstance(event.data, dict):
                    srv.malformed.append(f"bad types {event!r:.200}")
                if not await self.handle_event(event):
                    break
        finally:
            self.writer.close()


class StrictServer(FakeServer):
    """A FakeServer whose handler records every event it could not parse."""

    def __init__(self, port: int, **kwargs: Any) -> None:
        super().__init__(port, **kwargs)
        self.malformed: list[str] = []

    async def start(self) -> StrictServer:
        from wyoming.server import AsyncTcpServer

        self._server = AsyncTcpServer(HOST, self.port)
        await self._server.start(lambda r, w: _StrictHandler(r, w, self))
        return self


@asynccontextmanager
async def proxy_and_server(
    publish: Callable[[Any], None],
    **options: Any,
) -> AsyncIterator[tuple[WyomingProxy, StrictServer]]:
    """A StrictServer and a proxy in front of it (health known up before the test starts)."""
    server = await StrictServer(free_port()).start()
    options.setdefault("health_interval_s", None)
    proxy = WyomingProxy("whisper", HOST, 0, HOST, server.port, "stt", publish, **options)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(proxy.serve)
            await proxy.check_health()
            assert proxy.up is True
            yield proxy, server
            tg.cancel_scope.cancel()
    finally:
        await server.stop()


async def send_and_wait_closed(port: int, data: bytes, within_s: float = 5.0, *, eof: bool = False) -> bytes:
    """Send `data` (then EOF when `eof`), read until the proxy closes (EOF or reset); what came back."""
    received = bytearray()
    async with await anyio.connect_tcp(HOST, port) as stream:
        with anyio.fail_after(within_s):
            try:
                if data:
                    await stream.send(data)
                if eof:
                    await stream.send_eof()
                while True:
                    received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                pass
    return bytes(received)


async def until(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll (bounded) for a counter the proxy does not announce."""
    with anyio.fail_after(within_s):
        while True:
            if predicate():
                return
            await anyio.sleep(0.005)


def downs(log: Log) -> list[ServiceObservation]:
    return [o for o in log.items if isinstance(o, ServiceObservation) and o.up is False]


GARBAGE = {
    "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "binary": bytes(range(256)) * 300,
    "json-list": b'["type", "transcribe"]\n',
    "no-type": b'{"data": {"language": "en"}}\n',
    "huge-data-length": b'{"type": "transcribe", "data_length": 99999999999}\n',
    "huge-payload-length": b'{"type": "audio-chunk", "payload_length": 4294967296}\n',
    "negative-length": b'{"type": "audio-chunk", "payload_length": -5}\n',
    "string-length": b'{"type": "audio-chunk", "payload_length": "12"}\n',
    "data-length-lie": b'{"type": "transcribe", "data_length": 5}\n{"language": "en"}\n',
    "not-utf8": b'{"type": "transcribe\xff\xfe"}\n',
    "nan": b'{"type": "transcribe", "data": {"x": NaN}}\n',
    "long-line": b"{" + b" " * (MAX_HEADER_BYTES + 10),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(GARBAGE))
async def test_a_garbage_client_closes_only_its_own_connection(kind: str) -> None:
    """Garbage closes that client's connection and is logged; STT stays up and other clients are served."""
    published = Log()
    async with proxy_and_server(published) as (proxy, server):
        assert proxy.port is not None
        with capture_logs() as logs:
            await send_and_wait_closed(proxy.port, GARBAGE[kind])
        assert [e for e in logs if e["event"] == "wyoming_client_bad_input"], logs
        answer = await client_exchange(proxy.port, stt_request(2))
        assert [e.type for e in answer] == ["transcript"]
        assert proxy.up is True and downs(published) == []
        assert proxy.stats.bad_input == 1 and server.malformed == []
        assert all(e.type != "transcribe" or e.data == {"language": "en"} for e in server.received.items)
    assert [v for v in published.voice() if v[1] not in ("transcribe", "transcript")] == []


@pytest.mark.timeout(30)
async def test_garbage_after_audio_start_ends_that_stt_session_only() -> None:
    """A client that started STT and then sends garbage: its session ends (gate reopens), STT stays up."""
    published = Log()
    async with proxy_and_server(published) as (proxy, server):
        assert proxy.port is not None
        request = encode(stt_request(2)[:-1]) + b'{"type": "audio-chunk", "payload_length": -1}\n'
        await send_and_wait_closed(proxy.port, request)
        await server.received.wait_for(lambda _: sum(e.type == "audio-chunk" for e in server.received.items) == 2)
        off = await published.wait_for(lambda o: isinstance(o, VoiceActivity) and not o.active)
        assert off.event == "bad-input"
        assert published.voice() == [(True, "transcribe"), (False, "bad-input")]
        # what was well-formed before the garbage did reach the server, nothing after it
        assert [e.type for e in server.received.items][-3:] == ["audio-start", "audio-chunk", "audio-chunk"]
        assert proxy.up is True and downs(published) == [] and server.malformed == []


@pytest.mark.timeout(30)
async def test_a_truncated_event_is_never_forwarded() -> None:
    """A client closing mid-payload: the partial audio-chunk never reaches the server."""
    published = Log()
    async with proxy_and_server(published) as (proxy, server):
        assert proxy.port is not None
        chunk = encode([AudioChunk(RATE, WIDTH, CHANNELS, bytes(3200)).event()])
        request = encode([AudioStart(RATE, WIDTH, CHANNELS).event()]) + chunk[:-100]
        async with await anyio.connect_tcp(HOST, proxy.port) as stream:
            await stream.send(request)
            await server.received.wait_for(lambda e: e.type == "audio-start")
        await published.wait_for(lambda o: isinstance(o, VoiceActivity) and not o.active)
        await until(lambda: proxy.open_connections == 0)
        assert [e.type for e in server.received.items if e.type != "describe"] == ["audio-start"]
        assert server.malformed == [] and downs(published) == []


@pytest.mark.timeout(30)
async def test_idle_and_trickling_connections_are_closed_after_idle_timeout() -> None:
    """A silent client, a slowloris header and an STT client gone quiet are closed; STT stays up."""
    published = Log()
    async with proxy_and_server(published, idle_timeout_s=0.3) as (proxy, server):
        assert proxy.port is not None
        with anyio.fail_after(3):
            await send_and_wait_closed(proxy.port, b"")

        async def trickle() -> None:
            async with await anyio.connect_tcp(HOST, proxy.port) as stream:  # type: ignore[arg-type]
                header = b'{"type": "transcribe", "data": {"language": "en"}}\n'
                try:
                    for byte in header[:-1]:  # never the newline: a header that never ends
                        await stream.send(bytes([byte]))
                        await anyio.sleep(0.05)
                except (anyio.BrokenResourceError, OSError):
                    return
                pytest.fail("a trickled header kept the connection open")

        with anyio.fail_after(2):  # the header would take ~2.5 s to trickle
            await trickle()

        async with await anyio.connect_tcp(HOST, proxy.port) as stream:
            await stream.send(encode(stt_request(1)[:-1]))  # no audio-stop: the client went quiet
            off = await published.wait_for(lambda o: isinstance(o, VoiceActivity) and not o.active, within_s=3)
            assert off.event == "idle-timeout"
        assert proxy.stats.idle_timeouts == 3
        assert proxy.up is True and downs(published) == [] and server.malformed == []
        assert [e.type for e in await client_exchange(proxy.port, stt_request(1))] == ["transcript"]


@pytest.mark.timeout(30)
async def test_slow_audio_longer_in_total_than_idle_timeout_is_not_cut() -> None:
    """Audio keeps a session alive: chunks arriving more often than idle_timeout_s are never cut."""
    published = Log()
    async with proxy_and_server(published, idle_timeout_s=0.4) as (proxy, server):
        assert proxy.port is not None
        async with await anyio.connect_tcp(HOST, proxy.port) as stream:
            events = stt_request(6)
            for event in events:
                await stream.send(encode([event]))
                await anyio.sleep(0.1)  # slow audio, 1 s in all, each gap under the timeout
            answer = bytearray()
            with anyio.fail_after(5):
                while b"transcript" not in answer:
                    answer += await stream.receive()
        assert proxy.stats.idle_timeouts == 0


@pytest.mark.timeout(30)
async def test_connections_beyond_max_connections_are_refused_with_an_error_event() -> None:
    """With max_connections open, one more gets a Wyoming `error` (busy) and is closed; a slot frees."""
    published = Log()
    async with proxy_and_server(published, max_connections=3) as (proxy, server):
        assert proxy.port is not None
        streams = [await anyio.connect_tcp(HOST, proxy.port) for _ in range(3)]
        try:
            await until(lambda: proxy.open_connections == 3)
            refused = await send_and_wait_closed(proxy.port, b"")
            header, _, data = refused.partition(b"\n")
            assert json.loads(header)["type"] == "error"
            assert json.loads(data)["code"] == "busy" and proxy.stats.refused == 1
            await streams.pop().aclose()
            await until(lambda: proxy.open_connections == 2)
            assert [e.type for e in await client_exchange(proxy.port, stt_request(1))] == ["transcript"]
        finally:
            for s in streams:
                await s.aclose()
        assert proxy.up is True and downs(published) == []


@pytest.mark.timeout(30)
async def test_the_proxy_binds_loopback_by_default_and_logs_where() -> None:
    """A config proxy whose listen is a bare port binds 127.0.0.1 and the start log names the address."""
    server = await StrictServer(free_port()).start()
    try:
        service = ServiceConfig.model_validate(
            {"kind": "wyoming_stt", "proxy": {"listen": free_port(), "upstream": f"{HOST}:{server.port}"}}
        )
        (proxy,) = build_watchers({"whisper": service}, Log())
        assert isinstance(proxy, WyomingProxy) and proxy.listen_host == "127.0.0.1"
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                port = await tg.start(proxy.run)
                tg.cancel_scope.cancel()
        (line,) = [e for e in logs if e["event"] == "wyoming_proxy_listening"]
        assert line["listen"] == f"127.0.0.1:{port}" and line["loopback_only"] is True
        assert line["idle_timeout_s"] == 90.0 and line["max_connections"] == 32
    finally:
        await server.stop()


# -- generated bad input ------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
_LENGTH = st.one_of(
    st.integers(-10, 200),
    st.sampled_from([MAX_DATA_BYTES + 1, MAX_PAYLOAD_BYTES + 1, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def _header(draw: st.DrawFn) -> bytes:
    """One event as bytes: a header (often lying or mistyped), then some data and payload bytes."""
    header: dict[str, Any] = {}
    if draw(st.booleans()):
        header["type"] = draw(
            st.sampled_from(["transcribe", "audio-start", "audio-chunk", "audio-stop", "describe"]) | _JSON
        )
    if draw(st.booleans()):
        header["data"] = draw(_JSON)
    for key in ("data_length", "payload_length"):
        if draw(st.booleans()):
            header[key] = draw(_LENGTH)
    line = json.dumps(header).encode()
    line = draw(st.sampled_from([line, line[:-1], line + b"x", b"\xff" + line, b" " * 40 + line]))
    body = draw(st.sampled_from([b"", b'{"language": "en"}', b"[1, 2]", b"{", bytes(range(40))]))
    return line + b"\n" + body


_CLIENT_BYTES = st.lists(
    st.one_of(
        _header(),
        st.binary(max_size=64),
        st.just(encode(stt_request(1)[:2])),  # a valid start: the garbage may come mid-session
        st.just(encode([Transcript("x").event()])[:-3]),  # a truncated event
    ),
    min_size=1,
    max_size=4,
).map(b"".join)


@pytest.mark.timeout(120)
def test_generated_bad_input_never_reaches_the_upstream_malformed() -> None:
    """Generated headers (wrong types, no type, huge/negative/lying lengths, non-UTF-8, truncation):
    the proxy never crashes, keeps serving, STT stays up and every event upstream parses."""
    published = Log()
    with start_blocking_portal() as portal:
        cm = portal.wrap_async_context_manager(proxy_and_server(published, idle_timeout_s=0.5))
        with cm as (proxy, server):
            assert proxy.port is not None
            port = proxy.port

            expected = [len(server.received.items)]

            @settings(
                max_examples=100,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow],
            )
            @given(data=_CLIENT_BYTES)
            def check(data: bytes) -> None:
                types = [e.type for e in EventParser().feed(data)]  # what should reach the server
                if "audio-stop" in types:  # the server answers it and hangs up
                    types = types[: types.index("audio-stop") + 1]
                expected[0] += len(types)
                portal.call(partial(send_and_wait_closed, port, data, eof=True))
                portal.call(until, lambda: len(server.received.items) >= expected[0])
                assert server.malformed == [], (data, server.malformed)
                assert [e.type for e in server.received.items[expected[0] - len(types) :]] == types
                assert proxy.up is True and downs(published) == []

            check()
            answer = portal.call(client_exchange, port, stt_request(1))
            assert [e.type for e in answer] == ["transcript"]
            portal.call(until, lambda: proxy.open_connections == 0)
    acts = [o for o in published.items if isinstance(o, VoiceActivity)]
    assert sum(o.active for o in acts) == sum(not o.active for o in acts)
