"""A whisper-shaped model that does a real transcription's GPU work on random weights.

    stt = WhisperWork.load("small", device="cuda", dtype="float16")
    timings = stt.run(pcm16, text_tokens=7)     # log-mel, encoder, prefix + 7 decoder steps

No whisper weights reach the device machine (no network, no CTranslate2 with CUDA there), so the
weights are random; the work per request is what whisper does for a real clip: the log-mel of
the real audio (torch STFT on the device, whisper's 80 mel bands, padded to 30 s), the full
encoder over 1,500 frames, one decoder pass over the start-of-transcript prefix, then one
greedy decoder step per text token plus end-of-text, each with its KV cache and a host read of
the chosen token (a real decoder checks for end-of-text after every step).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

SAMPLE_RATE = 16000
N_FFT, HOP, N_MELS, CHUNK_S = 400, 160, 80, 30
N_SAMPLES = SAMPLE_RATE * CHUNK_S
"""Whisper pads or cuts every clip to 30 s (3,000 mel frames, 1,500 encoder positions)."""
PREFIX = (50258, 50259, 50359, 50363)
"""<|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|> (multilingual vocabulary)."""

SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (384, 4, 6, 1536),
    "base": (512, 6, 8, 2048),
    "small": (768, 12, 12, 3072),
    "medium": (1024, 24, 16, 4096),
}
"""OpenAI whisper's published shapes: d_model, layers (encoder = decoder), heads, FFN width."""

_TOKEN = re.compile(r"\w+|[^\w\s]")


def text_tokens(text: str) -> int:
    """Tokens whisper's GPT-2 BPE spends on `text`, estimated as one per word or punctuation mark
    (exact for the short common-English commands the bench speaks: " Turn", " on", ..., ".")."""
    return len(_TOKEN.findall(text))


@dataclass(frozen=True)
class Timings:
    """Where one transcription's time went (milliseconds, host clock, device synchronised)."""

    mel_ms: float
    """Upload and log-mel spectrogram."""
    encoder_ms: float
    """The encoder over 30 s of mel."""
    decoder_ms: float
    """Prefix pass and every greedy step."""
    steps: int
    """Decoder forward passes (1 prefix + text tokens + end of text)."""

    @property
    def total_ms(self) -> float:
        return self.mel_ms + self.encoder_ms + self.decoder_ms


class WhisperWork:
    """The model and its mel filters on one device; `run` is thread-safe (one at a time)."""

    def __init__(self, model: Any, filters: Any, device: str, dtype: Any, size: str) -> None:
        self.model, self.filters, self.device, self.dtype, self.size = model, filters, device, dtype, size
        self.lock = threading.Lock()

    @classmethod
    def load(cls, size: str = "small", *, device: str = "cuda", dtype: str = "float16", seed: int = 0) -> WhisperWork:
        """Build `size` with random weights (seeded) directly on `device`."""
        import torch
        from transformers import WhisperConfig, WhisperForConditionalGeneration
        from transformers.audio_utils import mel_filter_bank

        if size not in SIZES:
            raise ValueError(f"unknown whisper size {size!r}; expected one of {', '.join(SIZES)}")
        d, layers, heads, ffn = SIZES[size]
        cfg = WhisperConfig(
            vocab_size=51865,
            num_mel_bins=N_MELS,
            d_model=d,
            encoder_layers=layers,
            decoder_layers=layers,
            encoder_attention_heads=heads,
            decoder_attention_heads=heads,
            encoder_ffn_dim=ffn,
            decoder_ffn_dim=ffn,
            max_source_positions=1500,
            max_target_positions=448,
        )
        torch.manual_seed(seed)
        tdtype = getattr(torch, dtype)
        with torch.device(device):
            model = WhisperForConditionalGeneration(cfg)
        model = model.to(dtype=tdtype).eval()
        filters = mel_filter_bank(
            num_frequency_bins=1 + N_FFT // 2,
            num_mel_filters=N_MELS,
            min_frequency=0.0,
            max_frequency=8000.0,
            sampling_rate=SAMPLE_RATE,
            norm="slaney",
            mel_scale="slaney",
        )
        return cls(model, torch.tensor(filters.T, dtype=torch.float32, device=device), device, tdtype, size)

    def _sync(self) -> None:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)

    def log_mel(self, pcm16: bytes) -> Any:
        """[1, 80, 3000] log-mel of 16 kHz mono 16-bit PCM, as whisper computes it."""
        import torch

        audio = np.frombuffer(pcm16, dtype=np.int16)[:N_SAMPLES].astype(np.float32) / 32768.0
        x = torch.zeros(N_SAMPLES, dtype=torch.float32, device=self.device)
        x[: len(audio)] = torch.from_numpy(audio).to(self.device)
        stft = torch.stft(x, N_FFT, HOP, window=torch.hann_window(N_FFT, device=self.device), return_complex=True)
        power = stft[..., :-1].abs() ** 2  # [201, 3000]
        mel = self.filters @ power  # [80, 3000]
        log_spec = torch.clamp(mel, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return ((log_spec + 4.0) / 4.0).unsqueeze(0).to(self.dtype)

    def run(self, pcm16: bytes, text_tokens: int) -> Timings:
        """One transcription's work: mel, encoder, prefix pass, `text_tokens` + 1 greedy steps."""
        import torch

        with self.lock, torch.inference_mode():
            t0 = time.perf_counter()
            mel = self.log_mel(pcm16)
            self._sync()
            t1 = time.perf_counter()
            enc = self.model.model.encoder(input_features=mel).last_hidden_state  # [1, 1500, d]
            self._sync()
            t2 = time.perf_counter()
            ids = torch.tensor([PREFIX], device=self.device)
            past = None
            steps = 0
            for _ in range(text_tokens + 1):
                out = self.model.model.decoder(
                    input_ids=ids, encoder_hidden_states=enc, past_key_values=past, use_cache=True
                )
                past = out.past_key_values
                logits = self.model.proj_out(out.last_hidden_state[:, -1])  # [1, vocab]
                nxt = int(logits.argmax(-1).item())  # host reads it, as a real decoder does
                ids = torch.tensor([[nxt]], device=self.device)
                steps += 1
            t3 = time.perf_counter()
        return Timings((t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000, steps)
