"""One run of the scenario: voice turns at a fixed cadence, with or without background LLM load.

    result = anyio.run(run_scenario, ScenarioSpec(...), RunTarget(...))

The three scenarios differ only in what the spec says: ``idle`` (no load, no LLM call: STT and
the canned reply's TTS), ``contention`` and ``arbitration`` (the same background load and voice
turns; the daemon's policy, switched before the run, is the only difference).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import httpx
import psutil

from .pipeline import (
    LoadStats,
    Turn,
    ask_llm,
    background_client,
    health_probe,
    synthesize,
    transcribe,
)
from .utterances import Utterance


@dataclass(frozen=True)
class ScenarioSpec:
    """What one run does."""

    name: str
    """idle, contention or arbitration."""
    turns: int
    """Voice turns in the run."""
    period_s: float
    """A turn starts every `period_s` (or at once when the previous one overran)."""
    load_clients: int = 0
    """Background clients (0: none)."""
    load_tokens: int = 400
    """max_tokens of each background request."""
    llm: bool = True
    """Voice turns ask the LLM (False: TTS speaks the canned reply)."""
    voice_max_tokens: int = 32
    llm_deadline_s: float = 6.0
    """A voice turn's LLM step gives up after this (and speaks the canned reply)."""
    realtime: float = 1.0
    """Audio streaming speed (1: like a live microphone)."""
    load_settle_s: float = 3.0
    """Seconds the load runs before the first turn (so every turn meets a decoding engine)."""
    load_prompt_chars: int = 0
    """Context characters before each background request's question (0: the short STORY prompt)."""


@dataclass(frozen=True)
class RunTarget:
    """Where the daemon and its proxies are."""

    url: str
    stt_port: int
    """The whisper proxy."""
    tts_port: int
    """The Piper proxy (0: none, STT-only)."""
    tts_streaming: bool
    pids: dict[str, int] = field(default_factory=dict)
    """Processes to account CPU to."""


def _cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds (user + system) of each process, and `other`: everything else on the machine."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()  # the process itself: the servers are our children
            out[name] = t.user + t.system
        except psutil.Error:
            pass
    total = psutil.cpu_times()
    busy = (
        total.user
        + total.nice
        + total.system
        + getattr(total, "irq", 0)
        + getattr(total, "softirq", 0)
        + getattr(total, "steal", 0)
    )
    out["other"] = busy - sum(out.values())
    return out


async def run_scenario(
    spec: ScenarioSpec, target: RunTarget, utterances: list[tuple[Utterance, bytes]]
) -> dict[str, Any]:
    """Run `spec` against `target`; raw samples and per-process CPU as a JSON-ready dict."""
    pids = dict(target.pids, bench_client=os.getpid())
    load = LoadStats()
    probe: list[tuple[float, str, float]] = []
    turns: list[Turn] = []
    errors: list[str] = []
    async with (
        httpx.AsyncClient(base_url=target.url, timeout=httpx.Timeout(30, read=600)) as client,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(health_probe, target.url, probe)
        for k in range(spec.load_clients):
            tg.start_soon(
                lambda k=k: background_client(
                    client, load, max_tokens=spec.load_tokens, prompt_chars=spec.load_prompt_chars, client_id=k
                )
            )
        if spec.load_clients:
            await anyio.sleep(spec.load_settle_s)
        cpu0, t0 = _cpu_seconds(pids), time.time()
        for i in range(spec.turns):
            utt, pcm = utterances[i % len(utterances)]
            due = t0 + i * spec.period_s
            if due > time.time():
                await anyio.sleep(due - time.time())
            turn = Turn(utt)
            turns.append(turn)
            try:
                turn.stt = await transcribe(target.stt_port, pcm, realtime=spec.realtime)
                if spec.llm:
                    await ask_llm(client, turn, max_tokens=spec.voice_max_tokens, deadline_s=spec.llm_deadline_s)
                else:
                    turn.spoken = utt.reply
                if target.tts_port:  # 0: STT-only (the GPU bench has no TTS server)
                    turn.tts = await synthesize(target.tts_port, turn.spoken, streaming=target.tts_streaming)
            except (OSError, RuntimeError, TimeoutError, ConnectionError) as exc:
                errors.append(f"turn {i}: {type(exc).__name__}: {exc}"[:300])
        t1 = time.time()
        cpu1 = _cpu_seconds(pids)
        tg.cancel_scope.cancel()
    wall = t1 - t0
    return {
        "spec": asdict(spec),
        "t0": t0,
        "t1": t1,
        "turns": [_turn_json(t) for t in turns],
        "load": {
            "token_times": [t for t in load.token_times if t0 <= t <= t1],
            "tokens_all": len(load.token_times),
            "requests": load.requests,
            "errors": load.errors[:10],
        },
        "probe": [p for p in probe if t0 <= p[0] <= t1],
        "cpu_cores": {k: (cpu1[k] - cpu0[k]) / wall for k in cpu1 if k in cpu0} if wall > 0 else {},
        "errors": errors,
    }


def _turn_json(t: Turn) -> dict[str, Any]:
    return {
        "reference": t.utterance.text,
        "stt": None if t.stt is None else {**asdict(t.stt), "latency_ms": t.stt.latency_ms},
        "llm": {
            "start": t.llm_start,
            "first_token": t.llm_first_token,
            "sentence": t.llm_sentence,
            "tokens": t.llm_tokens,
            "status": t.llm_status,
        },
        "spoken": t.spoken,
        "tts": None if t.tts is None else {**asdict(t.tts), "ttfa_ms": t.tts.ttfa_ms},
    }
