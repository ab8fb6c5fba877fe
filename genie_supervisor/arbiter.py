"""The arbiter: applies decisions. ``DecodeGate`` is what the engine awaits between steps.

Gate modes: open, throttled (tokens/s cap, decode only), paused (a set of reasons). A paused gate
parks every generation at its next step; the gate records, per pause, the reaction time from
the observation that caused it to the moment the engine parked, and the time paused per reason.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus

from .policy.evaluate import evaluate
from .policy.schema import Policy
from .state import Decision, GateMode, StateStore

log = structlog.get_logger(__name__)


class DecodeGate:
    """Open / throttled(tps) / paused(reasons); implements the engine's ``Gate`` protocol."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._mode: GateMode = "open"
        self._reasons: frozenset[str] = frozenset()
        self._tps: float | None = None
        self._changed: anyio.Event | None = None
        self._generations = 0
        self._parked = 0
        self._next_slot = -math.inf
        self._pause_cause_ts: float | None = None
        self._pause_reacted = False
        self._reason_since: dict[str, float] = {}
        self._paused_s: dict[str, float] = {}
        self._pauses: dict[str, int] = {}
        self._reactions: deque[float] = deque(maxlen=512)
        self._steps = {"prefill": 0, "decode": 0}
        self._throttle_wait_s = 0.0

    # -- control ---------------------------------------------------------------------------
    @property
    def mode(self) -> GateMode:
        """Current mode."""
        return self._mode

    @property
    def reasons(self) -> frozenset[str]:
        """Why the gate is paused (empty unless paused)."""
        return self._reasons

    @property
    def throttle_tps(self) -> float | None:
        """Current decode cap, None unless throttled."""
        return self._tps

    def set_mode(self, mode: GateMode, *, reasons: frozenset[str] = frozenset(), tps: float | None = None,
            cause_ts: float | None = None) -> None:
        """Change mode; `cause_ts` is the observation time a new pause is measured from."""
        if mode == "throttled" and (tps is None or tps <= 0):
            raise ValueError("a throttled gate needs tokens/s > 0")
        now = self._clock()
        reasons = frozenset(reasons) if mode == "paused" else frozenset()
        for r in self._reasons - reasons:
            self._paused_s[r] = self._paused_s.get(r, 0.0) + now - self._reason_since.pop(r)
        for r in reasons - self._reasons:
            self._reason_since[r] = now
            self._pauses[r] = self._pauses.get(r, 0) + 1
        if mode == "paused" and self._mode != "paused":
            self._pause_cause_ts = now if cause_ts is None else cause_ts
            self._pause_reacted = False
            log.info("decode_paused", reasons=sorted(reasons), generations=self._generations)
        elif mode != "paused" and self._mode == "paused":
            log.info("decode_resumed", mode=mode)
        if mode == "throttled" and self._mode != "throttled":
            self._next_slot = -math.inf
        self._mode, self._reasons = mode, reasons
        self._tps = tps if mode == "throttled" else None
        self._wake()

    def open(self) -> None:
        """Let every step through."""
        self.set_mode("open")

    def throttle(self, tps: float) -> None:
        """Pace decode steps to `tps` tokens/s."""
        self.set_mode("throttled", tps=tps)

    def pause(self, reasons: frozenset[str] | set[str], cause_ts: float | None = None) -> None:
        """Park generations at their next step until the mode changes."""
        self.set_mode("paused", reasons=frozenset(reasons), cause_ts=cause_ts)

    def _wake(self) -> None:
        """Wake everyone waiting on the gate (mode or parked state changed)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    # -- the engine's side ------------------------------------------------------------------
    @contextmanager
    def generation(self) -> Iterator[None]:
        """Mark a generation as running: it holds the model and can take steps (the engine enters
        this via `running()` once it has the model; waiting for the model is not running)."""
        self._generations += 1
        try:
            yield
        finally:
            self._generations -= 1
            self._wake()

    running = generation  # the engine's optional Gate hook

    async def wait(self, phase: str) -> None:
        """Return when the next step may run: park while paused, pace decode while throttled."""
        while True:
            if self._mode == "paused":
                await self._park()
                continue
            now = self._clock()
            if self._mode == "throttled" and phase == "decode" and self._tps:
                interval = 1.0 / self._tps
                slot = self._next_slot if self._next_slot > now - interval else now
                if now < slot:
                    with anyio.move_on_after(slot - now):
                        await self._wait_changed()
                    self._throttle_wait_s += self._clock() - now
                    continue
                self._next_slot = slot + interval
            self._steps[phase] = self._steps.get(phase, 0) + 1
            return

    async def _wait_changed(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    async def _park(self) -> None:
        self._parked += 1
        if not self._pause_reacted and self._pause_cause_ts is not None:
            self._pause_reacted = True
            reaction_ms = (self._clock() - self._pause_cause_ts) * 1000.0
            self._reactions.append(reaction_ms)
            log.info("decode_parked", reasons=sorted(self._reasons), reaction_ms=round(reaction_ms, 3))
        self._wake()
        try:
            while self._mode == "paused":
                await self._wait_changed()
        finally:
            self._parked -= 1
            self._wake()

    # -- the voice path's side --------------------------------------------------------------
    @property
    def parked(self) -> bool:
        """True when no generation can take a step: none is running, or all are parked."""
        if self._generations == 0 and self._parked == 0:
            return True
        return self._mode == "paused" and self._parked >= max(self._generations, 1)

    async def wait_parked(self, timeout: float) -> bool:  # noqa: ASYNC109 - the proxy's bounded hold
        """Wait (bounded) until the engine is parked; returns at once when the gate is not paused.

        Returns whether the engine is parked (True also when nothing is generating).
        """
        with anyio.move_on_after(timeout):
            while not self.parked and self._mode == "paused":
                await self._wait_changed()
        return self.parked

    # -- metrics ----------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """Gate state and counters for /status, /metrics and MQTT."""
        now = self._clock()
        paused_s = dict(self._paused_s)
        for r, since in self._reason_since.items():
            paused_s[r] = paused_s.get(r, 0.0) + now - since
        rs = sorted(self._reactions)
        return {
            "mode": self._mode,
            "reasons": sorted(self._reasons),
            "throttle_tps": self._tps,
            "parked": self.parked,
            "generations": self._generations,
            "parked_generations": self._parked,
            "pauses_total": dict(self._pauses),
            "paused_seconds": {r: round(s, 6) for r, s in paused_s.items()},
            "reaction_ms_last": self._reactions[-1] if self._reactions else None,
            "reaction_ms_p50": statistics.median(rs) if rs else None,
            "reaction_ms_p99": rs[min(len(rs) - 1, math.ceil(0.99 * len(rs)) - 1)] if rs else None,
            "reactions": len(rs),
            "steps_total": dict(self._steps),
            "throttle_wait_seconds": round(self._throttle_wait_s, 6),
        }


class Arbiter:
    """Applies decisions: the decode gate, admission flags, and the unload request."""

    def __init__(self, gate: DecodeGate, *, on_unload: Callable[[], None] | None = None) -> None:
        self.gate = gate
        """The decode gate the engine awaits."""
        self.decision: Decision | None = None
        """The decision in force."""
        self._on_unload = on_unload
        self._listeners: list[Callable[[Decision], None]] = []

    @property
    def refuse_new(self) -> bool:
        """New requests are refused."""
        return self.decision is not None and self.decision.admission == "refuse_new"

    @property
    def max_context(self) -> int | None:
        """Largest context a new request may use (None: the model's)."""
        return self.decision.max_context if self.decision else None

    @property
    def prefill_chunk_tokens(self) -> int:
        """Prefill chunk size for new generations."""
        return self.decision.prefill_chunk_tokens if self.decision else 64

    def add_listener(self, fn: Callable[[Decision], None]) -> None:
        """Call `fn(decision)` after every decision change (admission, model manager, MQTT)."""
        self._listeners.append(fn)

    def apply(self, decision: Decision) -> bool:
        """Put `decision` into force; returns True (and logs one line) if its effect changed."""
        prev, self.decision = self.decision, decision
        if prev is not None and prev.effect() == decision.effect():
            return False
        if decision.gate == "paused":
            new = decision.pause_reasons - self.gate.reasons
            causes = [f.ts for f in decision.fired if f.reason in new and f.ts is not None]
            self.gate.pause(decision.pause_reasons, cause_ts=min(causes) if causes else None)
        elif decision.gate == "throttled":
            assert decision.throttle_tps is not None
            self.gate.throttle(decision.throttle_tps)
        else:
            self.gate.open()
        inputs: dict[str, Any] = {}
        for f in decision.fired:
            inputs.update(f.inputs)
        log.info("policy_decision", policy=decision.policy,
                 rule=",".join(f.rule for f in decision.fired) or "none",
                 inputs=inputs, action=decision.action_text())
        if decision.unload_llm and not (prev and prev.unload_llm) and self._on_unload is not None:
            self._on_unload()
        for fn in self._listeners:
            fn(decision)
        return True

    async def run(self, store: StateStore, get_policy: Callable[[], Policy | None], *,
                  task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Evaluate on every change of the store (and when a decision says to) and apply it."""
        task_status.started()
        version = -1
        while True:
            policy = get_policy()
            if policy is not None:
                decision = evaluate(policy, store.snapshot(), self.decision)
                store.set_decision(decision)
                self.apply(decision)
            version = store.version
            at = self.decision.next_eval_at if self.decision else None
            delay = math.inf if at is None else max(0.0, at - time.monotonic())
            with anyio.move_on_after(delay):
                await store.wait_changed(version)
