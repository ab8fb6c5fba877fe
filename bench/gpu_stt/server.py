"""The Wyoming side: the events wyoming-faster-whisper answers, over `WhisperWork`.

describe -> info (one ASR program, one model); transcribe (language) -> audio-start ->
audio-chunk... -> audio-stop -> transcript, then the connection's handler ends, as in
wyoming-faster-whisper. The transcript is the clip's reference text, looked up by the SHA-256 of
its PCM in the `transcripts` map the bench writes (random weights transcribe nothing); the
decoder takes as many steps as that text needs. Unknown audio gets an empty transcript after
`tokens_per_s` x its duration steps.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

with warnings.catch_warnings():  # wyoming.audio imports audioop, deprecated since Python 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    import wyoming.audio  # noqa: F401

from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioChunkConverter, AudioStart, AudioStop
from wyoming.event import Event
from wyoming.info import AsrModel, AsrProgram, Attribution, Describe, Info
from wyoming.server import AsyncEventHandler

from .model import SAMPLE_RATE, WhisperWork, text_tokens

ATTRIBUTION = Attribution(name="genie-supervisor bench", url="https://github.com/openai/whisper")


def pcm_key(pcm16: bytes) -> str:
    """The key of a clip in the transcripts map."""
    return hashlib.sha256(pcm16).hexdigest()[:16]


@dataclass
class ServerState:
    """What every connection shares."""

    work: WhisperWork
    """The model."""
    transcripts: dict[str, str] = field(default_factory=dict)
    """pcm_key -> reference text."""
    tokens_per_s: float = 3.0
    """Decoder steps per second of unknown audio."""
    requests: int = 0

    def info(self) -> Info:
        model = AsrModel(
            name=f"whisper-{self.work.size}-random",
            attribution=ATTRIBUTION,
            installed=True,
            description=f"whisper {self.work.size} shape, random weights ({self.work.device})",
            version="1",
            languages=["en"],
        )
        return Info(
            asr=[
                AsrProgram(
                    name="genie-gpu-stt",
                    attribution=ATTRIBUTION,
                    installed=True,
                    description="whisper-shaped GPU STT for the voice-path bench",
                    version="1",
                    models=[model],
                )
            ]
        )


class SttHandler(AsyncEventHandler):
    """One client connection."""

    def __init__(self, reader: Any, writer: Any, state: ServerState) -> None:
        super().__init__(reader, writer)
        self.state = state
        self.converter = AudioChunkConverter(rate=SAMPLE_RATE, width=2, channels=1)
        self.audio = bytearray()
        self.language: str | None = None

    async def handle_event(self, event: Event) -> bool:
        if Describe.is_type(event.type):
            await self.write_event(self.state.info().event())
            return True
        if Transcribe.is_type(event.type):
            self.language = Transcribe.from_event(event).language
            return True
        if AudioStart.is_type(event.type):
            self.audio.clear()
            return True
        if AudioChunk.is_type(event.type):
            self.audio += self.converter.convert(AudioChunk.from_event(event)).audio
            return True
        if AudioStop.is_type(event.type):
            pcm = bytes(self.audio)
            text = self.state.transcripts.get(pcm_key(pcm))
            n = text_tokens(text) if text is not None else int(len(pcm) / (2 * SAMPLE_RATE) * self.state.tokens_per_s)
            t0 = time.perf_counter()
            timings = await asyncio.to_thread(self.state.work.run, pcm, n)
            self.state.requests += 1
            print(
                json.dumps(
                    {
                        "event": "stt_done",
                        "t": time.time(),
                        "wall_ms": round((time.perf_counter() - t0) * 1000, 3),
                        "mel_ms": round(timings.mel_ms, 3),
                        "encoder_ms": round(timings.encoder_ms, 3),
                        "decoder_ms": round(timings.decoder_ms, 3),
                        "steps": timings.steps,
                        "audio_s": round(len(pcm) / (2 * SAMPLE_RATE), 3),
                        "known": text is not None,
                    }
                ),
                flush=True,
            )
            await self.write_event(Transcript(text or "").event())
            return False
        return True
