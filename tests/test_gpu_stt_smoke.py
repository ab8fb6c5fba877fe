"""The GPU voice bench's whisper-shaped STT server (bench/gpu_stt), run on the CPU with a tiny shape,
behind the daemon's Wyoming proxy: describe, transcribe, transcript, as the real whisper is seen.

Needs torch and transformers (not project dependencies): skipped cleanly where they are missing.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest

with warnings.catch_warnings():  # wyoming.audio imports audioop, deprecated since Python 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    import wyoming.audio  # noqa: F401

from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

from bench.gpu_stt.model import text_tokens
from bench.voice_path.gpu import speech_for, start_gpu_stt, stt_log, write_transcripts
from bench.voice_path.pipeline import transcribe
from bench.voice_path.stack import HOST
from bench.voice_path.utterances import Utterance
from genie_supervisor.events import VoiceActivity
from genie_supervisor.watchers.wyoming_proxy import WyomingProxy

UTTERANCES = (Utterance("Turn on the kitchen lights.", "Done."), Utterance("What time is it?", "Four."))


def test_text_tokens_counts_words_and_punctuation() -> None:
    """The decoder-step estimate is one token per word or punctuation mark."""
    assert text_tokens("Turn on the kitchen lights.") == 6
    assert text_tokens("Is the back door open?") == 6
    assert text_tokens("") == 0


def test_synthetic_speech_is_deterministic_and_keyed() -> None:
    """Each utterance's synthetic speech is the same bytes every time, so the transcripts map finds it."""
    a, b = speech_for(UTTERANCES), speech_for(UTTERANCES)
    assert [p for _, p in a] == [p for _, p in b]
    assert len(a[0][1]) > 16000 * 2  # over a second of 16 kHz 16-bit audio


async def _through_proxy(port: int, audio: list[tuple[Utterance, bytes]]) -> tuple[Info, list[str], list[Any]]:
    """Describe and transcribe every clip through a WyomingProxy in front of `port`."""
    published: list[Any] = []
    proxy = WyomingProxy("whisper", HOST, 0, HOST, port, "stt", published.append, health_interval_s=None)
    async with anyio.create_task_group() as tg:
        proxy_port = await tg.start(proxy.serve)
        async with AsyncTcpClient(HOST, proxy_port) as client:
            await client.write_event(Describe().event())
            with anyio.fail_after(30):
                event = await client.read_event()
                while event is not None and not Info.is_type(event.type):
                    event = await client.read_event()
        assert event is not None, "the server closed without answering describe"
        texts = [(await transcribe(proxy_port, pcm, realtime=0, timeout=120)).text for _, pcm in audio]
        tg.cancel_scope.cancel()
    return Info.from_event(event), texts, published


@pytest.mark.timeout(240)
def test_gpu_stt_server_through_the_wyoming_proxy(tmp_path: Path) -> None:
    """Through the daemon's Wyoming proxy the server answers describe with its ASR program and each
    clip with its reference transcript after text tokens + 1 decoder steps; the proxy sees the turn."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        pytest.skip("torch and transformers are not installed (the GPU STT server needs them)")
    audio = speech_for(UTTERANCES)
    transcripts = write_transcripts(tmp_path / "transcripts.json", audio)
    with start_gpu_stt(tmp_path, transcripts, size="tiny", device="cpu") as stack:
        info, texts, published = anyio.run(_through_proxy, stack.stt_port, audio)
    assert [p.name for p in info.asr] == ["genie-gpu-stt"]
    assert info.asr[0].models[0].name == "whisper-tiny-random"
    assert texts == [u.text for u in UTTERANCES]
    done = [e for e in stt_log(tmp_path) if e.get("event") == "stt_done"]
    assert [d["steps"] for d in done] == [text_tokens(u.text) + 1 for u in UTTERANCES]
    assert all(d["known"] and float(d["encoder_ms"]) > 0 for d in done)  # type: ignore[arg-type]
    voice = [(o.active, o.event) for o in published if isinstance(o, VoiceActivity)]
    assert (True, "transcribe") in voice
