"""What Home Assistant's voice pipeline does, plus the background LLM load and the probes.

A voice turn, over fresh connections through the daemon's Wyoming proxies, as Home Assistant does:
  STT  transcribe, audio-start, 100 ms chunks (paced like a live microphone), audio-stop -> transcript
  LLM  POST /v1/chat/completions, streaming, header ``X-Genie-Priority: voice``, until the first
       sentence (bounded by a deadline; past it the turn speaks its canned reply instead)
  TTS  synthesize-start / synthesize-chunk / synthesize-stop (plain `synthesize` when the server
       does not stream) -> the first audio chunk is the time to first audio
Background load: N clients asking, back to back, for long stories (priority background).
Probes: ``GET /health`` every 100 ms (the gate's mode, and the round trip as the loop-lag probe).
Every timestamp is wall-clock epoch seconds (``time.time()``), to line up with the daemon's log.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

with warnings.catch_warnings():  # wyoming.audio imports audioop, deprecated since Python 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    import wyoming.audio  # noqa: F401

from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from .stack import HOST
from .utterances import CHANNELS, RATE, WIDTH, Utterance

CHUNK_BYTES = RATE * WIDTH * CHANNELS // 10
"""100 ms of audio per chunk."""
PRIORITY_HEADER = "X-Genie-Priority"
SYSTEM = "You are a voice assistant in a smart home. Answer in one short sentence."
STORY = "Write a long, detailed story about a lighthouse keeper and a storm. Use many chapters."
_SENTENCE_END = re.compile(r"[.!?](\s|$)")


@dataclass
class SttResult:
    """One STT request through the proxy."""

    start: float
    """`transcribe` sent."""
    stop: float
    """`audio-stop` sent (all audio written)."""
    end: float
    """`transcript` received."""
    text: str
    """The transcript."""

    @property
    def latency_ms(self) -> float:
        """audio-stop -> transcript: what the user waits for after speaking."""
        return (self.end - self.stop) * 1000


@dataclass
class TtsResult:
    """One TTS request through the proxy."""

    start: float
    """First request event sent."""
    first_audio: float | None
    """First audio chunk received."""
    end: float
    """Last event received (synthesize-stopped, or audio-stop for plain synthesize)."""
    streaming: bool
    """Used the streaming events."""
    audio_s: float = 0.0
    """Seconds of audio received."""

    @property
    def ttfa_ms(self) -> float | None:
        return None if self.first_audio is None else (self.first_audio - self.start) * 1000


@dataclass
class Turn:
    """One voice turn."""

    utterance: Utterance
    stt: SttResult | None = None
    llm_start: float | None = None
    llm_first_token: float | None = None
    llm_sentence: float | None = None
    llm_tokens: int = 0
    llm_status: str = "skipped"
    """ok, deadline, error: ..., or skipped (idle run)."""
    spoken: str = ""
    tts: TtsResult | None = None


@dataclass
class LoadStats:
    """What the background clients got."""

    token_times: list[float] = field(default_factory=list)
    """Arrival time of every streamed token piece."""
    requests: int = 0
    """Requests that finished."""
    errors: list[str] = field(default_factory=list)


async def _read_until(client: AsyncTcpClient, types: set[str], timeout: float) -> Any:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        while True:
            event = await client.read_event()
            if event is None:
                raise ConnectionError("server closed the connection")
            if Error.is_type(event.type):
                raise RuntimeError(f"server error: {Error.from_event(event).text}")
            if event.type in types:
                return event


async def transcribe(port: int, pcm: bytes, *, realtime: float = 1.0, timeout: float = 30) -> SttResult:  # noqa: ASYNC109
    """Stream `pcm` to the STT server on `port` like a live microphone; the transcript and its timings."""
    async with AsyncTcpClient(HOST, port) as client:
        start = time.time()
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(RATE, WIDTH, CHANNELS).event())
        t0 = time.perf_counter()
        for i in range(0, len(pcm), CHUNK_BYTES):
            if realtime > 0:  # chunk i may leave once its audio has been "spoken"
                due = t0 + (i / (RATE * WIDTH * CHANNELS)) / realtime
                delay = due - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
            await client.write_event(AudioChunk(RATE, WIDTH, CHANNELS, pcm[i : i + CHUNK_BYTES]).event())
        await client.write_event(AudioStop().event())
        stop = time.time()
        event = await _read_until(client, {"transcript"}, timeout)
        end = time.time()
        return SttResult(start, stop, end, Transcript.from_event(event).text)


async def tts_streaming_supported(port: int, timeout: float = 5) -> bool:  # noqa: ASYNC109
    """Whether the TTS server advertises the streaming synthesize events."""
    async with AsyncTcpClient(HOST, port) as client:
        await client.write_event(Describe().event())
        info = Info.from_event(await _read_until(client, {"info"}, timeout))
    return any(p.supports_synthesize_streaming for p in info.tts)


async def synthesize(port: int, text: str, *, streaming: bool, timeout: float = 30) -> TtsResult:  # noqa: ASYNC109
    """Speak `text` through the TTS server on `port`; time to first audio and the audio's length."""
    first: float | None = None
    samples = 0
    rate = 22050
    async with AsyncTcpClient(HOST, port) as client:
        start = time.time()
        if streaming:
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text).event())
            await client.write_event(SynthesizeStop().event())
            done = SynthesizeStopped().event().type
        else:
            await client.write_event(Synthesize(text).event())
            done = AudioStop().event().type
        with anyio.fail_after(timeout):
            while True:
                event = await _read_until(client, {"audio-start", "audio-chunk", done}, timeout)
                if AudioStart.is_type(event.type):
                    rate = AudioStart.from_event(event).rate
                elif AudioChunk.is_type(event.type):
                    chunk = AudioChunk.from_event(event)
                    if first is None:
                        first = time.time()
                    samples += len(chunk.audio) // (chunk.width * chunk.channels)
                elif event.type == done:
                    break
        return TtsResult(start, first, time.time(), streaming, samples / rate)


async def tts_audio(port: int, text: str, timeout: float = 60) -> tuple[bytes, int]:  # noqa: ASYNC109
    """The whole audio (16-bit mono PCM, rate) of `text` from the TTS server, plain `synthesize`."""
    pcm = bytearray()
    rate = 22050
    async with AsyncTcpClient(HOST, port) as client:
        await client.write_event(Synthesize(text).event())
        while True:
            event = await _read_until(client, {"audio-start", "audio-chunk", "audio-stop"}, timeout)
            if AudioStart.is_type(event.type):
                start = AudioStart.from_event(event)
                rate = start.rate
                if start.width != 2 or start.channels != 1:
                    raise ValueError(f"expected 16-bit mono TTS audio, got {start.width * 8}-bit x{start.channels}")
            elif AudioChunk.is_type(event.type):
                pcm += AudioChunk.from_event(event).audio
            else:
                return bytes(pcm), rate


async def sse_pieces(client: httpx.AsyncClient, body: dict[str, Any], priority: str) -> AsyncIterator[str]:
    """Yield the content pieces of a streaming chat completion (OpenAI SSE)."""
    async with client.stream("POST", "/v1/chat/completions", json=body, headers={PRIORITY_HEADER: priority}) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:200]
            raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    yield piece


async def ask_llm(client: httpx.AsyncClient, turn: Turn, *, max_tokens: int, deadline_s: float) -> None:
    """The turn's LLM step: stream until the first sentence ends, within `deadline_s`."""
    body = {
        "model": "default",
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": turn.stt.text if turn.stt else turn.utterance.text},
        ],
    }
    text = ""
    turn.llm_start = time.time()
    turn.llm_status = "deadline"
    with anyio.move_on_after(deadline_s):
        try:
            async for piece in sse_pieces(client, body, "voice"):
                turn.llm_tokens += 1
                if turn.llm_first_token is None:
                    turn.llm_first_token = time.time()
                text += piece
                m = _SENTENCE_END.search(text)
                if m:
                    text = text[: m.end()]
                    break
            turn.llm_sentence = time.time()
            turn.llm_status = "ok"
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            turn.llm_status = f"error: {exc}"[:200]
    turn.spoken = text.strip() if turn.llm_status == "ok" and text.strip() else turn.utterance.reply


CONTEXT = (
    "The keeper wrote in the log every night: the wind, the sea, the ships that passed, the lamp's "
    "oil, the state of the lens and the letters he meant to send. "
)
"""A paragraph repeated to make a long background prompt (a document to summarise, a long chat)."""


def long_prompt(chars: int) -> str:
    """STORY after `chars` characters of context (0: STORY alone)."""
    if chars <= 0:
        return STORY
    return (CONTEXT * (chars // len(CONTEXT) + 1))[:chars] + "\n\n" + STORY


async def background_client(
    client: httpx.AsyncClient, stats: LoadStats, *, max_tokens: int, prompt_chars: int = 0, client_id: int = 0
) -> None:
    """Ask for long stories back to back until cancelled; every token's arrival is recorded.

    With `prompt_chars`, each request opens with its own number, so no two share a cached prefix
    and every request pays its whole prefill."""
    text = long_prompt(prompt_chars)
    n = 0
    while True:
        n += 1
        content = f"Request {client_id}-{n}. {text}" if prompt_chars else text
        body = {
            "model": "default",
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "seed": 1,
            "messages": [{"role": "user", "content": content}],
        }
        try:
            async for _ in sse_pieces(client, body, "background"):
                stats.token_times.append(time.time())
            stats.requests += 1
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            stats.errors.append(str(exc)[:200])
            await anyio.sleep(0.5)


async def health_probe(url: str, out: list[tuple[float, str, float]], period: float = 0.1) -> None:
    """(time, gate mode, /health round trip ms) every `period` until cancelled."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while True:
            t0 = time.perf_counter()
            try:
                gate = str((await client.get("/health")).json().get("gate"))
            except (httpx.HTTPError, ValueError):
                gate = "error"
            rtt = (time.perf_counter() - t0) * 1000
            out.append((time.time(), gate, rtt))
            await anyio.sleep(max(0.0, period - rtt / 1000))
