"""The voice-path benchmark's harness end to end, small: one utterance per run, a tiny LLM load.

The real daemon (subprocess, SmolLM2) runs with its Wyoming proxies in front of small but real
Wyoming servers built on the `wyoming` package (an STT server that answers with the utterance's
text, a TTS server that streams a tone), so every part of `bench/voice_path` runs -- audio
preparation and cache, policy switching by SIGHUP, the three scenarios, the daemon-log parsing,
the summary table and the timeline plot -- without the heavy whisper/Piper stack.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from wyoming.asr import Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.event import Event
from wyoming.info import Describe
from wyoming.server import AsyncEventHandler
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

from bench.voice_path.__main__ import main
from bench.voice_path.stack import HOST, VoiceStack
from bench.voice_path.utterances import Utterance, resample, word_errors
from tests.models import SMOLLM2, require
from tests.wyoming_info import server_info

TEXT = "Turn on the kitchen lights."


class _Handler(AsyncEventHandler):
    """STT: the fixed transcript after audio-stop. TTS: 0.3 s of a 440 Hz tone per request."""

    def __init__(self, reader: Any, writer: Any, kind: str) -> None:
        super().__init__(reader, writer)
        self.kind = kind
        self.streaming = False

    async def handle_event(self, event: Event) -> bool:
        if Describe.is_type(event.type):
            await self.write_event(server_info(self.kind, self.kind, "m" if self.kind == "stt" else "v").event())
            return True
        if self.kind == "stt" and AudioStop.is_type(event.type):
            await asyncio.sleep(0.05)
            await self.write_event(Transcript(TEXT).event())
            return False
        if self.kind == "tts":
            if SynthesizeStart.is_type(event.type):
                self.streaming = True
            elif SynthesizeStop.is_type(event.type):
                await self._speak()
                await self.write_event(SynthesizeStopped().event())
                return False
            elif Synthesize.is_type(event.type) and not self.streaming:
                await self._speak()
                return False
            elif SynthesizeChunk.is_type(event.type):
                pass
        return True

    async def _speak(self) -> None:
        rate = 22050
        pcm = b"".join(
            int(8000 * math.sin(2 * math.pi * 440 * i / rate)).to_bytes(2, "little", signed=True)
            for i in range(int(0.3 * rate))
        )
        await self.write_event(AudioStart(rate, 2, 1).event())
        for i in range(0, len(pcm), 4096):
            await self.write_event(AudioChunk(rate, 2, 1, pcm[i : i + 4096]).event())
        await self.write_event(AudioStop().event())


@contextmanager
def tiny_stack(_workdir: Path) -> Iterator[VoiceStack]:
    """Both servers in a thread with its own event loop, for the length of the block; each listens on
    a port the kernel picked when it bound (port 0), so no other process can take it in between."""
    ports: dict[str, int] = {}
    ready, stop = threading.Event(), None
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        servers = []
        for kind in ("stt", "tts"):

            async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kind: str = kind) -> None:
                await _Handler(reader, writer, kind).run()

            server = await asyncio.start_server(client, HOST, 0)
            ports[kind] = server.sockets[0].getsockname()[1]
            servers.append(server)
        ready.set()
        await stop.wait()
        for server in servers:
            server.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10), "tiny Wyoming servers did not start"
    try:
        yield VoiceStack(ports["stt"], ports["tts"], voice="tiny-tone", describe="tiny Wyoming STT/TTS (tests)")
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


def test_word_errors_and_resample() -> None:
    """WER ignores case and punctuation; resampling keeps the duration."""
    assert word_errors("Turn on the kitchen lights.", "turn on the kitchen light") == (1, 5)
    assert word_errors("Good night.", "good night") == (0, 2)
    import numpy as np

    out = resample(np.zeros(22050, dtype=np.int16), 22050, 16000)
    assert len(out) == 16000 and out.dtype == np.int16


@pytest.mark.timeout(90)
def test_harness_runs_three_scenarios_and_writes_the_report(tmp_path: Path) -> None:
    """Idle, contention (policy off) and arbitration (default policy) each complete one voice turn;
    the arbitration run pauses decode while STT runs, the contention run never does."""
    model = require(SMOLLM2)
    out = tmp_path / "out"
    main(
        [
            "--rounds",
            "1",
            "--turns",
            "1",
            "--period",
            "0",
            "--load-clients",
            "1",
            "--load-tokens",
            "6",
            "--load-settle",
            "0.5",
            "--voice-max-tokens",
            "4",
            "--llm-deadline",
            "2",
            "--realtime",
            "0",
            "--warmup",
            "0",
            "--model",
            str(model),
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
            "--window",
            "10",
        ],
        stack_factory=tiny_stack,
        audio_cache=tmp_path / "audio",
        utterances=(Utterance(TEXT, "Done."),),
        say=lambda m: None,
    )
    results = json.loads((out / "results.json").read_text())
    runs = {r["spec"]["name"]: r for r in results["runs"]}
    assert set(runs) == {"idle", "contention", "arbitration"}
    for name, run in runs.items():
        assert run["errors"] == [], name
        (turn,) = run["turns"]
        assert turn["stt"]["text"] == TEXT and turn["stt"]["latency_ms"] > 0
        assert turn["tts"]["streaming"] and turn["tts"]["ttfa_ms"] is not None
    assert runs["idle"]["turns"][0]["llm"]["status"] == "skipped"
    assert runs["contention"]["turns"][0]["llm"]["start"] is not None
    paused = {name: [e for e in run["gate_log"] if e["event"] == "decode_paused"] for name, run in runs.items()}
    assert paused["arbitration"] and not paused["contention"]
    assert results["summary"]["idle"]["wer"] == 0.0
    assert runs["arbitration"]["policy"] == "default" and runs["contention"]["policy"] == "bench-voice-off"
    summary = (out / "summary.md").read_text()
    assert "STT p95 (ms)" in summary and "| ratio to idle | contention | arbitration |" in summary
    assert (out / "timeline.png").stat().st_size > 10_000
    assert len(list((tmp_path / "audio").glob("*.wav"))) == 1
