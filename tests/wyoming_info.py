"""The `Info` that the tests' small Wyoming servers describe themselves with."""

from __future__ import annotations

from typing import Any

from wyoming.info import AsrModel, AsrProgram, Attribution, Info, TtsProgram, TtsVoice

ATTRIBUTION = Attribution(name="tests", url="http://localhost")


def server_info(kind: str, program: str, model: str) -> Info:
    """An STT (`kind` "stt") or streaming TTS (any other kind) server `program` with one English `model`."""
    about: dict[str, Any] = dict(attribution=ATTRIBUTION, installed=True, description=None, version="1")
    if kind == "stt":
        return Info(asr=[AsrProgram(name=program, models=[AsrModel(name=model, languages=["en"], **about)], **about)])
    voice = TtsVoice(name=model, languages=["en"], **about)
    return Info(tts=[TtsProgram(name=program, voices=[voice], supports_synthesize_streaming=True, **about)])
