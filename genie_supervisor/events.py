"""Observations: what watchers, telemetry, the engine and voice hints report (frozen, timestamped).

Every observation carries `ts`, a `time.monotonic()` timestamp taken when the fact was observed;
reaction times (observation -> engine parked) are measured from it. Nothing here does I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal


def now() -> float:
    """The clock every observation uses (monotonic seconds)."""
    return time.monotonic()


@dataclass(frozen=True)
class TelemetrySample:
    """One sample of the platform: temperatures, load, power and memory."""

    platform: str
    """Telemetry source that produced it: ``jetson``, ``nvml``, ``linux`` or ``simulated``."""
    ts: float = field(default_factory=now)
    """Monotonic time of the sample."""
    temps_c: dict[str, float] = field(default_factory=dict)
    """Temperature per sensor name (e.g. ``gpu``, ``cpu``, ``tj``) in °C."""
    trip_points_c: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Kernel trip points per sensor (passive/hot/critical) in °C, where the platform has them."""
    gpu_load_pct: float | None = None
    """GPU utilisation 0–100, None where unknown."""
    gpu_freq_mhz: float | None = None
    """Current GPU clock in MHz, None where unknown."""
    cpu_load_pct: float | None = None
    """Whole-machine CPU utilisation 0–100."""
    power_w: dict[str, float] = field(default_factory=dict)
    """Power per rail (e.g. ``VDD_IN``) in watts."""
    mem_total_mb: float | None = None
    """MemTotal in MiB."""
    mem_available_mb: float | None = None
    """MemAvailable in MiB (what the policy's memory thresholds compare against)."""
    swap_total_mb: float | None = None
    """SwapTotal in MiB."""
    swap_used_mb: float | None = None
    """SwapTotal - SwapFree in MiB."""
    gpu_mem_used_mb: float | None = None
    """GPU memory in use in MiB (discrete GPUs; unified-memory boxes report RAM instead)."""
    power_mode: str | None = None
    """nvpmodel mode name on Jetson (e.g. ``15W``), None elsewhere."""


@dataclass(frozen=True)
class ServiceObservation:
    """What a watcher saw of one neighbour service (whisper, piper, dfn, homeassistant)."""

    service: str
    """Configured service name."""
    up: bool | None
    """True up, False down, None unknown (never found / watcher lost it)."""
    ts: float = field(default_factory=now)
    """Monotonic time of the observation."""
    reason: str = ""
    """Why it is in that state (e.g. ``process not found``, ``health 503``)."""
    rss_mb: float | None = None
    """Resident memory (or cgroup memory for containers) in MiB."""
    cpu_pct: float | None = None
    """CPU use in percent of one core."""
    gpu_mem_mb: float | None = None
    """GPU memory of the service's processes where the platform exposes it."""
    restarts: int = 0
    """Times the watcher saw the service come back after being down."""
    pids: tuple[int, ...] = ()
    """Process ids found for the service."""
    counters: dict[str, int] = field(default_factory=dict)
    """Service-specific counters, e.g. ``dfn_underruns``."""


VoiceService = Literal["stt", "tts"]


@dataclass(frozen=True)
class VoiceActivity:
    """The voice path started or stopped using the machine (from the Wyoming proxy or a hint)."""

    service: VoiceService
    """``stt`` (speech-to-text) or ``tts`` (text-to-speech)."""
    active: bool
    """True when the service starts working, False when it is done."""
    source: str
    """Where it came from: ``proxy:<name>``, ``http``, ``mqtt``, ``heuristic``."""
    ts: float = field(default_factory=now)
    """Monotonic time of the event."""
    session: str | None = None
    """Identifies one request (e.g. the proxy connection), so overlapping requests are counted."""
    event: str = ""
    """The protocol event that caused it (e.g. ``audio-start``, ``transcript``)."""


@dataclass(frozen=True)
class EngineStats:
    """What the engine is doing, published by the model manager / generation loop."""

    state: str
    """``idle``, ``loading``, ``prefill``, ``decoding``, ``paused``, ``throttled``, ``error``, ``disabled``."""
    ts: float = field(default_factory=now)
    """Monotonic time of the sample."""
    model: str | None = None
    """Loaded model name."""
    backend: str | None = None
    """Engine backend: ``numpy``, ``cupy``, ``llama_cpp`` or ``openai``."""
    decode_tps: float | None = None
    """Decode speed of the running / last generation in tokens/s."""
    first_token_ms: float | None = None
    """Time to first token of the last request in ms."""
    tokens_total: int = 0
    """Tokens generated since start."""
    requests_in_flight: int = 0
    """Generations running now."""
    requests_queued: int = 0
    """Requests waiting for admission."""
    weights_mb: float | None = None
    """Memory of the loaded weights in MiB."""
    kv_mb: float | None = None
    """Memory of the KV cache in MiB."""
    rss_mb: float | None = None
    """Resident memory of the supervisor process in MiB."""
    remote_url: str | None = None
    """backend openai: the remote's base URL (no credentials)."""
    remote_model: str | None = None
    """backend openai: the model name the remote serves."""
    remote_state: str | None = None
    """backend openai: ``up``, ``down``, ``unknown``, or ``fallback`` while the local fallback answers."""
    scratch_mb: float | None = None
    """Planned scratch (activations, prefill buffers) of the loaded models in MiB."""
    n_ctx: int | None = None
    """Context the loaded model's KV cache is sized for."""
    kv_dtype: str | None = None
    """KV cache element type of the loaded model (``f16``, ``int8``)."""
    ready_s: float | None = None
    """Seconds from process start to ready (the resident models loaded: a first token servable)."""


@dataclass(frozen=True)
class RequestDone:
    """One API request that finished (or was cut short), as the API saw it."""

    model: str
    """Id of the model that served it."""
    priority: str
    """Request class it was admitted as (``voice``, ``tool``, ``background``, ...)."""
    finish_reason: str
    """``stop``, ``length``, ``tool_calls``, ``cancelled`` (client gone, unload or shutdown)."""
    ts: float = field(default_factory=now)
    """Monotonic time it finished."""
    prompt_tokens: int = 0
    """Tokens of the prompt."""
    completion_tokens: int = 0
    """Tokens generated."""
    first_token_ms: float | None = None
    """From the request reaching the daemon to its first generated text (queueing included), in ms."""
    decode_tps: float | None = None
    """Decode speed of this request in tokens/s, None where the backend did not say."""


Observation = TelemetrySample | ServiceObservation | VoiceActivity | EngineStats | RequestDone
