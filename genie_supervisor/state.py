"""The snapshot store: the latest observation of everything, plus the decision taken on it.

Watchers, telemetry, the engine and voice hints call ``StateStore.publish(observation)``; the
arbiter loop, the MQTT publisher and ``/status`` read ``snapshot()`` or await changes. The store
runs on the event loop's thread (publish from other threads through ``anyio.from_thread``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

import anyio
from anyio.abc import TaskStatus

from .events import (
    EngineStats,
    Observation,
    RequestDone,
    ServiceObservation,
    TelemetrySample,
    VoiceActivity,
    now,
)

GateMode = Literal["open", "throttled", "paused"]


@dataclass(frozen=True)
class FiredRule:
    """One policy rule that fired, with what it saw (for the canonical decision log line)."""

    rule: str
    """Policy key of the rule, e.g. ``voice.stt``, ``thermal.levels[hot]``, ``memory.thresholds[0]``."""
    action: str
    """What it asks for: ``pause``, ``throttle``, ``refuse_new``, ``shrink_context``, ``unload_llm``."""
    reason: str
    """Short reason carried by the gate and metrics: ``stt``, ``tts``, ``thermal``, ``memory``, ..."""
    inputs: Mapping[str, Any] = field(default_factory=dict)
    """The observed values that made it fire."""
    ts: float | None = None
    """Timestamp of the observation that made it fire (reaction times are measured from it)."""
    throttle_tps: float | None = None
    """Decode cap asked for by a throttle action."""


@dataclass(frozen=True)
class PriorityClass:
    """One request class as admission applies it."""

    name: str
    """Class name requests carry."""
    max_queue: int
    """Requests of this class that may wait; more are refused."""
    max_wait_s: float
    """A queued request is refused after waiting this long (seconds)."""


@dataclass(frozen=True)
class PriorityTable:
    """The request classes admission serves, highest priority first, and the class of requests that name none."""

    classes: tuple[PriorityClass, ...]
    """Classes, highest priority first."""
    default_class: str
    """Class of requests that name none."""


DEFAULT_LLM_BUDGET_MB: float = 2560
"""The LLM's memory budget (MiB) until a decision says otherwise (the policy schema's default)."""

DEFAULT_PRIORITIES = PriorityTable(
    classes=(PriorityClass("voice", 4, 5.0), PriorityClass("tool", 8, 30.0), PriorityClass("background", 16, 300.0)),
    default_class="background",
)
"""The request classes until a decision says otherwise (the policy schema's default)."""


@dataclass(frozen=True)
class Decision:
    """What the policy decided for one snapshot; also carries the hysteresis state for the next one."""

    ts: float
    """Snapshot time it was made for (monotonic seconds)."""
    policy: str = ""
    """Name of the policy that made it."""
    gate: GateMode = "open"
    """Decode gate mode."""
    pause_reasons: frozenset[str] = frozenset()
    """Why decode is paused (empty unless the gate is paused)."""
    throttle_tps: float | None = None
    """Decode cap in tokens/s (the lowest asked for), None when not throttled."""
    throttle_reasons: frozenset[str] = frozenset()
    """Why decode is throttled."""
    admission: Literal["accept", "refuse_new"] = "accept"
    """Whether new requests are accepted."""
    max_context: int | None = None
    """Largest context new requests may use, None for the model's own limit."""
    unload_llm: bool = False
    """The LLM should be unloaded to give memory back."""
    thermal_level: str | None = None
    """Active thermal level name (hysteresis state)."""
    memory_active: tuple[int, ...] = ()
    """Indices of the memory thresholds that fire (hysteresis state)."""
    prefill_chunk_tokens: int = 64
    """Prefill chunk size for new generations."""
    prefill_layer_group: int = 0
    """Layers between two gate checks inside a prefill chunk for new generations (0: whole chunks)."""
    llm_budget_mb: float | None = DEFAULT_LLM_BUDGET_MB
    """The LLM's memory budget from the policy (MiB; None: no limit)."""
    priorities: PriorityTable = DEFAULT_PRIORITIES
    """The request classes and their limits from the policy (what admission serves)."""
    fired: tuple[FiredRule, ...] = ()
    """Every rule that fired, in policy order."""
    next_eval_at: float | None = None
    """When the decision changes with no new observation (a hold-off ends, telemetry goes stale)."""
    voice_passes: frozenset[str] = frozenset()
    """Pause and throttle reasons that protect the voice path (``stt``, ``tts``, ``stt_unknown``):
    a generation of the voice class is not held by them."""
    voice_gate: GateMode = "open"
    """Decode gate mode for a generation of the voice class (held only by the other reasons)."""
    voice_throttle_tps: float | None = None
    """Decode cap for the voice class: the lowest throttle of the other reasons, None when not throttled."""

    def effect(self) -> tuple[Any, ...]:
        """What the arbiter acts on through the gate and its listeners; two decisions with equal
        effects need no such action (the budget and priorities are pushed whenever they change)."""
        return (
            self.gate,
            self.pause_reasons,
            self.throttle_tps,
            self.admission,
            self.max_context,
            self.unload_llm,
            self.thermal_level,
            self.prefill_chunk_tokens,
            self.prefill_layer_group,
            self.voice_gate,
            self.voice_throttle_tps,
        )

    def action_text(self) -> str:
        """The effect as a short text, e.g. ``paused(stt,thermal) refuse_new max_context=1024``."""
        if self.gate == "paused":
            parts = [f"paused({','.join(sorted(self.pause_reasons))})"]
        elif self.gate == "throttled":
            parts = [f"throttled({self.throttle_tps:g}tps:{','.join(sorted(self.throttle_reasons))})"]
        else:
            parts = ["open"]
        if self.admission != "accept":
            parts.append(self.admission)
        if self.max_context is not None:
            parts.append(f"max_context={self.max_context}")
        if self.unload_llm:
            parts.append("unload_llm")
        if self.thermal_level:
            parts.append(f"thermal={self.thermal_level}")
        if (self.voice_gate, self.voice_throttle_tps) != (self.gate, self.throttle_tps):
            parts.append(
                f"voice={self.voice_gate}"
                + (f"({self.voice_throttle_tps:g}tps)" if self.voice_gate == "throttled" else "")
            )
        return " ".join(parts)


@dataclass(frozen=True)
class VoiceState:
    """What the voice path is doing."""

    stt_active: bool = False
    """Speech-to-text is working (at least one open session)."""
    tts_active: bool = False
    """Text-to-speech is working."""
    stt_sessions: int = 0
    """Open STT sessions (overlapping requests are counted)."""
    tts_sessions: int = 0
    """Open TTS sessions."""
    stt_active_since: float | None = None
    """When STT went active (start of the oldest open session)."""
    tts_active_since: float | None = None
    """When TTS went active."""
    stt_idle_since: float | None = None
    """When STT last went idle (None if it never ran)."""
    tts_idle_since: float | None = None
    """When TTS last went idle."""
    hint_expires_at: float | None = None
    """When the oldest open session expires for lack of a stop (hint timeout)."""
    stt_unknown: bool = False
    """A watched STT service is in an unknown state (its watcher lost it)."""


@dataclass(frozen=True)
class Snapshot:
    """Everything known at one moment."""

    ts: float
    """When the snapshot was taken (monotonic seconds)."""
    started_ts: float
    """When the store started (telemetry counts as missing only some time after it)."""
    telemetry: TelemetrySample | None = None
    """Latest platform sample."""
    services: Mapping[str, ServiceObservation] = field(default_factory=dict)
    """Latest observation per watched service."""
    voice: VoiceState = field(default_factory=VoiceState)
    """Voice path state."""
    engine: EngineStats | None = None
    """Latest engine stats."""
    policy_name: str | None = None
    """Policy in force."""
    policy_error: str | None = None
    """Last policy (re)load error, None if the last load was clean."""
    decision: Decision | None = None
    """Latest decision."""
    version: int = 0
    """Grows with every change that may alter a decision."""
    requests: tuple[RequestDone, ...] = ()
    """The last finished API requests, oldest first (at most ``REQUESTS_KEPT``)."""


REQUESTS_KEPT = 32
"""Finished requests the store keeps for the web page (a ring: the oldest goes first)."""


class StateStore:
    """Holds the latest snapshot; publish() updates it and wakes whoever waits for a change."""

    def __init__(
        self,
        *,
        hint_timeout_s: float = 30.0,
        stt_services: Iterable[str] = (),
        clock: Callable[[], float] = now,
    ) -> None:
        self.hint_timeout_s = hint_timeout_s
        """An open voice session with no stop expires after this many seconds."""
        self._stt_services = frozenset(stt_services)
        self._clock = clock
        self._started = clock()
        self._telemetry: TelemetrySample | None = None
        self._services: dict[str, ServiceObservation] = {}
        self._engine: EngineStats | None = None
        self._requests: deque[RequestDone] = deque(maxlen=REQUESTS_KEPT)
        self._open: dict[str, dict[str, list[float]]] = {"stt": {}, "tts": {}}
        self._idle_since: dict[str, float | None] = {"stt": None, "tts": None}
        self._policy: tuple[str | None, str | None] = (None, None)
        self._decision: Decision | None = None
        self._version = 0
        self._event: anyio.Event | None = None
        self._listeners: list[Callable[[], None]] = []

    # -- writing ---------------------------------------------------------------------------
    def publish(self, obs: Observation) -> None:
        """Record one observation and notify subscribers."""
        if isinstance(obs, TelemetrySample):
            self._telemetry = obs
        elif isinstance(obs, ServiceObservation):
            self._services[obs.service] = obs
        elif isinstance(obs, EngineStats):
            self._engine = obs
        elif isinstance(obs, VoiceActivity):
            self._voice(obs)
        elif isinstance(obs, RequestDone):
            self._requests.append(obs)
        else:
            raise TypeError(f"not an observation: {type(obs).__name__}")
        self._expire(self._clock())
        self._changed()

    def _voice(self, ev: VoiceActivity) -> None:
        sessions = self._open[ev.service]
        key = ev.session if ev.session is not None else f"{ev.source}#"
        if ev.active:
            sessions.setdefault(key, []).append(ev.ts)
            return
        starts = sessions.get(key)
        if not starts and ev.session is None:
            # an anonymous stop closes the oldest anonymous start of any source
            anon = [k for k, v in sessions.items() if k.endswith("#") and v]
            key = min(anon, key=lambda k: sessions[k][0]) if anon else key
            starts = sessions.get(key)
        if not starts:
            return
        starts.pop(0)
        if not starts:
            del sessions[key]
        if not any(sessions.values()):
            self._idle_since[ev.service] = ev.ts

    def expire(self, at: float | None = None) -> bool:
        """Drop voice starts older than the hint timeout; True (and subscribers woken) if any went."""
        if self._expire(self._clock() if at is None else at):
            self._changed()
            return True
        return False

    def _expire(self, at: float) -> bool:
        dropped = False
        for service, sessions in self._open.items():
            was_active = any(sessions.values())
            last_expiry = None
            for key in list(sessions):
                keep = [t for t in sessions[key] if at - t < self.hint_timeout_s]
                for t in sessions[key]:
                    if at - t >= self.hint_timeout_s:
                        last_expiry = max(last_expiry or -math.inf, t + self.hint_timeout_s)
                if len(keep) != len(sessions[key]):
                    dropped = True
                if keep:
                    sessions[key] = keep
                else:
                    del sessions[key]
            if was_active and not sessions and last_expiry is not None:
                self._idle_since[service] = last_expiry
        return dropped

    def set_hint_timeout(self, seconds: float) -> None:
        """Change the hint timeout (the policy may override the config's)."""
        self.hint_timeout_s = seconds
        self.expire()

    def set_policy(self, name: str | None, error: str | None) -> None:
        """Record the policy in force and the last load error; wakes subscribers."""
        self._policy = (name, error)
        self._changed()

    def set_decision(self, decision: Decision) -> None:
        """Record the latest decision (does not wake subscribers: it is derived from the snapshot)."""
        self._decision = decision

    def add_listener(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call `fn()` synchronously after every change, before `publish` returns (the arbiter
        decides in the same loop turn as the observation); returns the function that removes it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn)

    def _changed(self) -> None:
        self._version += 1
        if self._event is not None:
            self._event.set()
            self._event = None
        for fn in list(self._listeners):
            fn()

    # -- reading ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Grows with every change."""
        return self._version

    def snapshot(self) -> Snapshot:
        """The current state, frozen."""
        return Snapshot(
            ts=self._clock(),
            started_ts=self._started,
            telemetry=self._telemetry,
            services=MappingProxyType(dict(self._services)),
            voice=self._voice_state(),
            engine=self._engine,
            policy_name=self._policy[0],
            policy_error=self._policy[1],
            decision=self._decision,
            version=self._version,
            requests=tuple(self._requests),
        )

    def _voice_state(self) -> VoiceState:
        def starts(service: str) -> list[float]:
            return sorted(t for v in self._open[service].values() for t in v)

        stt, tts = starts("stt"), starts("tts")
        oldest = min([*stt[:1], *tts[:1]], default=None)
        unknown = any(self._services[s].up is None for s in self._stt_services if s in self._services)
        return VoiceState(
            stt_active=bool(stt),
            tts_active=bool(tts),
            stt_sessions=len(stt),
            tts_sessions=len(tts),
            stt_active_since=stt[0] if stt else None,
            tts_active_since=tts[0] if tts else None,
            stt_idle_since=self._idle_since["stt"],
            tts_idle_since=self._idle_since["tts"],
            hint_expires_at=None if oldest is None else oldest + self.hint_timeout_s,
            stt_unknown=unknown,
        )

    async def wait_changed(self, since: int) -> int:
        """Wait until the version is above `since`; returns the new version."""
        while self._version <= since:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()
        return self._version

    async def subscribe(self) -> AsyncIterator[Snapshot]:
        """Yield the snapshot now and after every change (changes in between are coalesced)."""
        seen = -1
        while True:
            if self._version == seen:
                await self.wait_changed(seen)
            seen = self._version
            yield self.snapshot()

    async def run_expiry(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Expire hint starts on time even when nothing else happens (run in the task group)."""
        task_status.started()
        while True:
            version = self._version
            at = self._voice_state().hint_expires_at
            delay = math.inf if at is None else max(0.0, at - self._clock())
            with anyio.move_on_after(delay):
                await self.wait_changed(version)
            self.expire()


def with_decision(snapshot: Snapshot, decision: Decision) -> Snapshot:
    """The same snapshot carrying `decision`."""
    return replace(snapshot, decision=decision)
