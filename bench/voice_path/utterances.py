"""The fixed home-assistant utterances, their speech audio (Piper's own voice), and word error rate.

Speech is made once per text and voice through a Wyoming TTS server, resampled to 16 kHz mono
16-bit (what Home Assistant streams to STT) and cached as WAV files, keyed by a hash of the
text and the voice, so every run transcribes exactly the same audio.
"""

from __future__ import annotations

import hashlib
import re
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

RATE, WIDTH, CHANNELS = 16000, 2, 1
"""What the STT client streams: 16 kHz, 16-bit, mono."""


@dataclass(frozen=True)
class Utterance:
    """One spoken command and the reply spoken when the LLM does not answer in time."""

    text: str
    """What is said (the reference for word error rate)."""
    reply: str
    """A canned first sentence for TTS (idle run, or an LLM that missed its deadline)."""


UTTERANCES: tuple[Utterance, ...] = (
    Utterance("Turn on the kitchen lights.", "Turning on the kitchen lights."),
    Utterance("Turn off the bedroom lamp.", "The bedroom lamp is off."),
    Utterance("What is the weather like today?", "It is sunny and mild today."),
    Utterance("Start a timer for the pasta.", "Your pasta timer is running."),
    Utterance("Lock the front door.", "The front door is locked."),
    Utterance("Close the garage door.", "Closing the garage door."),
    Utterance("Dim the living room lights.", "Dimming the living room lights."),
    Utterance("Is the back door open?", "The back door is closed."),
    Utterance("Play some music in the kitchen.", "Playing music in the kitchen."),
    Utterance("Turn up the heating in the office.", "Turning up the heating in the office."),
    Utterance("What time is it?", "It is half past four."),
    Utterance("Add milk to the shopping list.", "I added milk to your shopping list."),
    Utterance("Open the blinds in the bedroom.", "Opening the bedroom blinds."),
    Utterance("Start the robot vacuum.", "The vacuum is starting."),
    Utterance("Good night.", "Good night, sleep well."),
)


def resample(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Band-limited resampling of a whole clip (FFT: truncate or pad the spectrum); int16 in, int16 out."""
    if src_rate == dst_rate:
        return samples.astype(np.int16)
    x = samples.astype(np.float64)
    n_out = int(round(len(x) * dst_rate / src_rate))
    spectrum = np.fft.rfft(x)
    keep = n_out // 2 + 1
    out_spec = np.zeros(keep, dtype=complex)
    m = min(keep, len(spectrum))
    out_spec[:m] = spectrum[:m]
    y = np.fft.irfft(out_spec, n_out) * (n_out / len(x))
    return np.clip(np.round(y), -32768, 32767).astype(np.int16)


def cache_key(text: str, voice: str) -> str:
    """File stem for one text spoken by one voice."""
    return hashlib.sha256(f"{voice}\n{text}".encode()).hexdigest()[:16]


def write_wav(path: Path, pcm: bytes, rate: int = RATE) -> None:
    """16-bit mono WAV, written atomically."""
    tmp = path.with_suffix(".tmp")
    with wave.open(str(tmp), "wb") as w:
        w.setnchannels(CHANNELS)
        w.setsampwidth(WIDTH)
        w.setframerate(rate)
        w.writeframes(pcm)
    tmp.replace(path)


def read_wav(path: Path) -> bytes:
    """PCM of a 16 kHz mono 16-bit WAV (refuses anything else)."""
    with wave.open(str(path), "rb") as w:
        if (w.getframerate(), w.getsampwidth(), w.getnchannels()) != (RATE, WIDTH, CHANNELS):
            raise ValueError(f"{path}: expected {RATE} Hz, {WIDTH * 8}-bit, mono")
        return w.readframes(w.getnframes())


_WORD = re.compile(r"[a-z0-9']+")


def words(text: str) -> list[str]:
    """Lower-case words without punctuation (what WER compares)."""
    return _WORD.findall(text.lower().replace("-", " "))


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + deletions + insertions, reference words): word-level Levenshtein."""
    ref, hyp = words(reference), words(hypothesis)
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1], len(ref)


def wer(pairs: list[tuple[str, str]]) -> float | None:
    """Corpus word error rate over (reference, hypothesis) pairs; None when there are none."""
    errors = total = 0
    for ref, hyp in pairs:
        e, n = word_errors(ref, hyp)
        errors, total = errors + e, total + n
    return errors / total if total else None
