"""The Wyoming proxy against real Wyoming servers (the `wyoming` package) on loopback."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.event import Event, write_event
from wyoming.info import Describe
from wyoming.server import AsyncEventHandler, AsyncTcpServer
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from genie_supervisor.events import ServiceObservation, VoiceActivity
from genie_supervisor.watchers.wyoming_proxy import EventScanner, WyomingProxy, probe_wyoming
from tests.awaitlog import Log as BaseLog
from tests.net import HOST, free_port
from tests.wyoming_info import server_info

RATE, WIDTH, CHANNELS = 16000, 2, 1


class Log(BaseLog):
    """The published observations, with a view of the voice events."""

    def voice(self) -> list[tuple[bool, str]]:
        return [(o.active, o.event) for o in self.items if isinstance(o, VoiceActivity)]


class FakeServer:
    """A Wyoming STT or TTS server on a fixed port, recording what it receives."""

    def __init__(
        self,
        port: int,
        kind: str = "stt",
        *,
        delay_s: float = 0.0,
        text: str = "turn on the kitchen lights",
        streaming: bool = False,
        order: Log | None = None,
        held: bool = False,
    ) -> None:
        """`held`: answer only once `answer_gate` is set."""
        self.port, self.kind, self.delay_s, self.text = port, kind, delay_s, text
        self.streaming = streaming
        self.received = Log()
        self.order = order if order is not None else Log()
        self.answer_gate: anyio.Event | None = anyio.Event() if held else None
        self.dead = False
        self._server: AsyncTcpServer | None = None

    async def start(self) -> FakeServer:
        self._server = AsyncTcpServer(HOST, self.port)
        await self._server.start(lambda r, w: _Handler(r, w, self))
        return self

    async def __aenter__(self) -> FakeServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        self.dead = True
        if self.answer_gate is not None:
            self.answer_gate.set()
        assert self._server is not None
        await self._server.stop()


class _Handler(AsyncEventHandler):
    def __init__(self, reader: Any, writer: Any, server: FakeServer) -> None:
        super().__init__(reader, writer)
        self.server = server
        self.text: list[str] = []
        self.streaming_request = False

    async def handle_event(self, event: Event) -> bool:
        srv = self.server
        srv.received(event)
        srv.order(f"server:{event.type}")
        if Describe.is_type(event.type):
            await self.write_event(server_info(srv.kind, f"fake-{srv.kind}", "fake").event())
            return True
        if srv.kind == "stt" and AudioStop.is_type(event.type):
            if srv.answer_gate is not None:
                await srv.answer_gate.wait()
            if srv.dead:
                return False
            await anyio.sleep(srv.delay_s)
            if srv.streaming:
                await self.write_event(TranscriptStart(language="en").event())
                for word in srv.text.split():
                    await self.write_event(TranscriptChunk(word + " ").event())
            await self.write_event(Transcript(srv.text).event())
            if srv.streaming:
                await self.write_event(TranscriptStop().event())
            return False
        if srv.kind == "tts":
            if SynthesizeStart.is_type(event.type):
                self.streaming_request = True
            elif SynthesizeChunk.is_type(event.type):
                self.text.append(SynthesizeChunk.from_event(event).text)
            elif SynthesizeStop.is_type(event.type):
                for sentence in self.text:
                    await self._speak(sentence)
                await self.write_event(SynthesizeStopped().event())
            elif Synthesize.is_type(event.type) and not self.streaming_request:
                await self._speak(Synthesize.from_event(event).text)
        return True

    async def _speak(self, text: str) -> None:
        await self.write_event(AudioStart(22050, WIDTH, CHANNELS).event())
        for i in range(3):
            audio = (text.encode() * 100)[:1024] + bytes([i])
            await self.write_event(AudioChunk(22050, WIDTH, CHANNELS, audio).event())
        await self.write_event(AudioStop().event())


def stt_request(chunks: int = 5) -> list[Event]:
    """What Home Assistant sends for one STT request."""
    events = [Transcribe(language="en").event(), AudioStart(RATE, WIDTH, CHANNELS).event()]
    for i in range(chunks):
        audio = bytes((i * 7 + j) % 256 for j in range(3200))
        events.append(AudioChunk(RATE, WIDTH, CHANNELS, audio).event())
    events.append(AudioStop().event())
    return events


def encode(events: list[Event]) -> bytes:
    buffer = io.BytesIO()
    for event in events:
        write_event(event, buffer)
    return buffer.getvalue()


@asynccontextmanager
async def running_proxy(
    upstream_port: int, publish: Callable[[Any], None], service: str = "stt", **options: Any
) -> AsyncIterator[WyomingProxy]:
    options.setdefault("health_interval_s", None)
    proxy = WyomingProxy(
        "whisper" if service == "stt" else "piper", HOST, 0, HOST, upstream_port, service, publish, **options
    )  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(proxy.serve)
        yield proxy
        tg.cancel_scope.cancel()


async def raw_exchange(port: int, request: bytes, piece: int = 0) -> bytes:
    """Send `request` (in `piece`-byte writes when set) and read everything until the server closes."""
    async with await anyio.connect_tcp(HOST, port) as stream:
        if piece:
            for i in range(0, len(request), piece):
                await stream.send(request[i : i + piece])
        else:
            await stream.send(request)
        received = bytearray()
        with anyio.fail_after(5):
            while True:
                try:
                    received += await stream.receive()
                except anyio.EndOfStream:
                    return bytes(received)


async def client_exchange(port: int, events: list[Event], until: str | None = None) -> list[Event]:
    """Send events as Home Assistant would and collect the answer until the server closes (or up to the first
    event of type `until`)."""
    answer = []
    async with AsyncTcpClient(HOST, port) as client:
        for event in events:
            await client.write_event(event)
        with anyio.fail_after(5):
            while (event := await client.read_event()) is not None:
                answer.append(event)
                if event.type == until:
                    break
    return answer


def as_tuples(events: list[Event]) -> list[tuple[str, dict[str, Any], bytes | None]]:
    return [(e.type, e.data, e.payload) for e in events]


# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_scanner_finds_events_however_the_stream_is_split() -> None:
    """The scanner reports the same event types whether bytes arrive whole or one at a time."""
    data = encode(stt_request(3) + [Transcript("hi").event()])
    whole = [t for _, t in EventScanner().feed(data)]
    scanner = EventScanner()
    single = [t for i in range(len(data)) for _, t in scanner.feed(data[i : i + 1])]
    assert (
        whole
        == single
        == ["transcribe", "audio-start", "audio-chunk", "audio-chunk", "audio-chunk", "audio-stop", "transcript"]
    )
    assert not scanner.broken
    broken = EventScanner()
    assert broken.feed(b"GET / HTTP/1.1\r\n") == [] and broken.broken


@pytest.mark.timeout(20)
async def test_stt_bytes_and_events_are_identical_with_and_without_proxy() -> None:
    """Through the proxy the client gets exactly the bytes the server sends directly, and vice versa."""
    port = free_port()
    async with FakeServer(port, delay_s=0.01) as server:
        published = Log()
        request = encode(stt_request())
        async with running_proxy(port, published) as proxy:
            assert proxy.port is not None
            direct = await raw_exchange(port, request)
            direct_received = as_tuples(server.received.items)
            server.received.items.clear()
            proxied = await raw_exchange(proxy.port, request, piece=7)
            assert proxied == direct and b"turn on the kitchen lights" in proxied
            assert as_tuples(server.received.items) == direct_received

            server.received.items.clear()
            events_direct = as_tuples(await client_exchange(port, stt_request()))
            events_proxied = as_tuples(await client_exchange(proxy.port, stt_request()))
            assert events_proxied == events_direct
            assert events_direct[0][0] == "transcript"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("streaming", [False, True])
async def test_stt_active_from_transcribe_until_transcript(streaming: bool) -> None:
    """STT is active before the server sees `transcribe` and idle when `transcript` is relayed."""
    port = free_port()
    order = Log()
    async with FakeServer(port, streaming=streaming, order=order):

        def publish(obs: Any) -> None:
            if isinstance(obs, VoiceActivity):
                order(f"stt:{'on' if obs.active else 'off'}:{obs.event}")

        async with running_proxy(port, publish) as proxy:
            assert proxy.port is not None
            answer = await client_exchange(proxy.port, stt_request(2))
    assert order.items[0] == "stt:on:transcribe"
    assert order.items[1] == "server:transcribe"
    assert order.items.index("server:audio-stop") < order.items.index("stt:off:transcript")
    assert [i for i in order.items if i.startswith("stt:")] == ["stt:on:transcribe", "stt:off:transcript"]
    assert Transcript.from_event(next(e for e in answer if e.type == "transcript")).text == "turn on the kitchen lights"


@pytest.mark.timeout(20)
async def test_overlapping_connections_are_separate_sessions() -> None:
    """Two requests at once give two sessions, each switched on and off once."""
    port = free_port()
    async with FakeServer(port, held=True) as server:
        published = Log()
        async with running_proxy(port, published) as proxy, anyio.create_task_group() as tg:
            assert proxy.port is not None
            for _ in range(2):
                tg.start_soon(client_exchange, proxy.port, stt_request(1))
            await server.received.wait_for(lambda e: e.type == "audio-stop")
            await published.wait_for(lambda _: sum(1 for o in published.items if isinstance(o, VoiceActivity)) == 2)
            server.answer_gate.set()
    acts = [o for o in published.items if isinstance(o, VoiceActivity)]
    sessions = {o.session for o in acts}
    assert len(sessions) == 2
    for session in sessions:
        assert [o.active for o in acts if o.session == session] == [True, False]


@pytest.mark.timeout(20)
async def test_audio_stop_is_held_until_the_engine_is_parked() -> None:
    """`audio-stop` reaches the server only after wait_parked returns, and STT was active first."""
    port = free_port()
    order = Log()
    async with FakeServer(port, order=order) as server:
        published = Log()
        entered, release = anyio.Event(), anyio.Event()

        async def wait_parked(max_s: float) -> bool:
            assert published.voice() and published.voice()[-1][0] is True
            order("hold:enter")
            entered.set()
            with anyio.move_on_after(max_s):
                await release.wait()
                order("hold:released")
                return True
            return False

        async with running_proxy(port, published, wait_parked=wait_parked, hold_max_s=20) as proxy:
            assert proxy.port is not None
            async with AsyncTcpClient(HOST, proxy.port) as client:
                for event in stt_request(3):
                    await client.write_event(event)
                await entered.wait()
                await server.received.wait_for(
                    lambda _: sum(e.type == "audio-chunk" for e in server.received.items) == 3
                )
                assert "audio-stop" not in [e.type for e in server.received.items]
                release.set()
                with anyio.fail_after(5):
                    answer = await client.read_event()
            assert answer is not None and answer.type == "transcript"
            assert proxy.stats.holds == 1 and proxy.stats.hold_timeouts == 0
    assert order.items.index("hold:released") < order.items.index("server:audio-stop")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("honours_timeout", [True, False])
async def test_audio_stop_is_forwarded_after_hold_max_when_never_parked(
    honours_timeout: bool,
) -> None:
    """An engine that never parks delays `audio-stop` by at most hold_max_s, then it goes through."""
    port = free_port()
    async with FakeServer(port):

        async def never_parked(max_s: float) -> bool:
            if honours_timeout:
                await anyio.sleep(max_s)
            else:
                await anyio.sleep_forever()
            return False

        async with running_proxy(port, Log(), wait_parked=never_parked, hold_max_s=0.2) as proxy:
            assert proxy.port is not None
            answer = await client_exchange(proxy.port, stt_request(2))
            assert [e.type for e in answer] == ["transcript"]
            assert proxy.stats.hold_timeouts == 1
            assert proxy.stats.last_hold_ms is not None and proxy.stats.last_hold_ms >= 150


@pytest.mark.timeout(20)
@pytest.mark.parametrize("streaming", [False, True])
async def test_tts_active_from_synthesize_until_done(streaming: bool) -> None:
    """TTS is active from `synthesize`/`synthesize-start` to `audio-stop`/`synthesize-stopped`."""
    port = free_port()
    async with FakeServer(port, "tts"):
        published = Log()
        text = "The lights are on. Anything else?"
        if streaming:
            request = [
                SynthesizeStart().event(),
                SynthesizeChunk("The lights are on. ").event(),
                SynthesizeChunk("Anything else?").event(),
                Synthesize(text).event(),
                SynthesizeStop().event(),
            ]
            until = "synthesize-stopped"
        else:
            request = [Synthesize(text).event()]
            until = "audio-stop"
        async with running_proxy(port, published, service="tts") as proxy:
            assert proxy.port is not None
            direct = await client_exchange(port, request, until)
            proxied = await client_exchange(proxy.port, request, until)
            assert as_tuples(proxied) == as_tuples(direct)
            await published.wait_for(lambda o: isinstance(o, VoiceActivity) and not o.active)
    first = "synthesize-start" if streaming else "synthesize"
    assert published.voice() == [(True, first), (False, until)]
    assert all(o.service == "tts" for o in published.items if isinstance(o, VoiceActivity))


@pytest.mark.timeout(30)
async def test_upstream_dying_mid_request_closes_client_and_reports_down_then_up() -> None:
    """A server dying mid-request: client closed, STT idle, service down; up again after restart."""
    port = free_port()
    server = await FakeServer(port, held=True).start()
    published = Log()
    try:
        async with running_proxy(port, published, health_interval_s=0.1) as proxy:
            assert proxy.port is not None
            await published.wait_for(lambda o: isinstance(o, ServiceObservation) and o.up)
            async with AsyncTcpClient(HOST, proxy.port) as client:
                for event in stt_request(2):
                    await client.write_event(event)
                await server.received.wait_for(lambda e: e.type == "audio-stop")
                mark = len(published.items)
                await server.stop()
                with anyio.fail_after(5):
                    assert await client.read_event() is None
            off = await published.wait_for(lambda o: isinstance(o, VoiceActivity) and not o.active, start=mark)
            assert off.event == "upstream-closed"
            down = await published.wait_for(lambda o: isinstance(o, ServiceObservation) and o.up is False, start=mark)
            assert "mid-request" in down.reason or "connect failed" in down.reason

            mark = len(published.items)
            server = await FakeServer(port).start()
            up = await published.wait_for(lambda o: isinstance(o, ServiceObservation) and o.up, start=mark)
            assert up.restarts == 1
            answer = await client_exchange(proxy.port, stt_request(1))
            assert [e.type for e in answer] == ["transcript"]
    finally:
        await server.stop()


@pytest.mark.timeout(20)
async def test_unreachable_upstream_closes_the_client_and_reports_down() -> None:
    """With nothing listening upstream the client is closed at once and the service is down."""
    published = Log()
    async with running_proxy(free_port(), published) as proxy:
        assert proxy.port is not None
        answer = await client_exchange(proxy.port, stt_request(1))
        assert answer == []
        down = await published.wait_for(lambda o: isinstance(o, ServiceObservation))
        assert down.up is False and "connect failed" in down.reason
    assert published.voice() in ([], [(True, "transcribe"), (False, "close")])


@pytest.mark.timeout(20)
async def test_health_probe_describe_info() -> None:
    """`describe` gets `info` from a live server; a silent or absent server is down within the deadline."""
    port = free_port()
    async with FakeServer(port):
        assert await probe_wyoming(HOST, port, 1.0) == (True, "describe ok")

    async def silent(stream: Any) -> None:
        async with stream:
            await anyio.sleep_forever()

    listener = await anyio.create_tcp_listener(local_host=HOST, local_port=0)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, silent)
        silent_port = listener.extra(anyio.abc.SocketAttribute.local_port)
        up, reason = await probe_wyoming(HOST, silent_port, 0.3)
        assert not up and "no info within 0.3s" in reason
        tg.cancel_scope.cancel()
    up, reason = await probe_wyoming(HOST, free_port(), 1.0)
    assert not up and "connect failed" in reason


@pytest.mark.timeout(20)
async def test_cancelling_serve_closes_the_listener() -> None:
    """Cancelling `serve` stops listening and ends open sessions as idle."""
    port = free_port()
    async with FakeServer(port, held=True) as server:
        published = Log()
        async with anyio.create_task_group() as tg:
            proxy = WyomingProxy("whisper", HOST, 0, HOST, port, "stt", published, health_interval_s=None)
            proxy_port = await tg.start(proxy.serve)
            client = AsyncTcpClient(HOST, proxy_port)
            await client.connect()
            for event in stt_request(1):
                await client.write_event(event)
            await server.received.wait_for(lambda e: e.type == "audio-stop")
            tg.cancel_scope.cancel()
        await client.disconnect()
    assert published.voice() == [(True, "transcribe"), (False, "close")]
    with pytest.raises(OSError):
        await anyio.connect_tcp(HOST, proxy_port)
