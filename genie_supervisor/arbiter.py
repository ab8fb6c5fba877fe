"""The arbiter: applies decisions. ``DecodeGate`` is what the engine awaits between steps.

Gate modes: open, throttled (tokens/s cap, decode only), paused (a set of reasons). A paused gate
parks every generation at its next step; the gate records, per pause, the reaction time from
the observation that caused it to the moment the engine parked, and the time paused per reason.
A generation of the voice class (``VOICE_CLASS``) has a mode of its own: the pauses and throttles
that protect the voice path do not hold the voice turn's own reply (the policy decides which).

The arbiter decides in the same loop turn as an observation is published (a store listener), so
a generation that finishes its step right after a voice event finds the gate already paused.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import anyio
import structlog
from anyio.abc import TaskStatus

from .policy.evaluate import evaluate
from .policy.schema import Policy
from .state import Decision, GateMode, PriorityTable, StateStore

log = structlog.get_logger(__name__)

VOICE_CLASS = "voice"
"""The request class whose generations pass the pauses that protect the voice path."""


class DecodeGate:
    """Open / throttled(tps) / paused(reasons); implements the engine's ``Gate`` protocol."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._mode: GateMode = "open"
        self._reasons: frozenset[str] = frozenset()
        self._tps: float | None = None
        self._voice: tuple[GateMode, float | None] | None = None
        self._changed: anyio.Event | None = None
        self._generations = 0
        self._by_class: Counter[str | None] = Counter()
        self._parked = 0
        self._next_slot = -math.inf
        self._pause_cause_ts: float | None = None
        self._pause_reacted = False
        self._reason_since: dict[str, float] = {}
        self._paused_s: dict[str, float] = {}
        self._pauses: dict[str, int] = {}
        self._reactions: deque[float] = deque(maxlen=512)
        self._steps = {"prefill": 0, "decode": 0}
        self._passed = 0
        self._last_phase: str | None = None
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

    def mode_for(self, priority: str | None) -> tuple[GateMode, float | None]:
        """The mode and decode cap a generation of class `priority` sees."""
        if priority == VOICE_CLASS and self._voice is not None:
            return self._voice
        return self._mode, self._tps

    def set_mode(
        self,
        mode: GateMode,
        *,
        reasons: frozenset[str] = frozenset(),
        tps: float | None = None,
        cause_ts: float | None = None,
        voice: tuple[GateMode, float | None] | None = None,
    ) -> None:
        """Change mode; `cause_ts` is the observation time a new pause is measured from; `voice` is
        the voice class's own (mode, tokens/s) where it differs (None: the same as everyone's)."""
        if mode == "throttled" and (tps is None or tps <= 0):
            raise ValueError("a throttled gate needs tokens/s > 0")
        if voice is not None and voice[0] == "throttled" and (voice[1] is None or voice[1] <= 0):
            raise ValueError("a throttled voice class needs tokens/s > 0")
        if voice is not None and voice[0] == "paused" and mode != "paused":
            raise ValueError("the voice class can only be paused while the gate is")
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
            log.info(
                "decode_paused",
                reasons=sorted(reasons),
                generations=self._generations,
                voice=voice[0] if voice is not None else mode,
            )
        elif mode != "paused" and self._mode == "paused":
            log.info("decode_resumed", mode=mode)
        if mode == "throttled" and self._mode != "throttled":
            self._next_slot = -math.inf
        self._mode, self._reasons = mode, reasons
        self._tps = tps if mode == "throttled" else None
        self._voice = (
            None
            if voice is None or voice == (mode, self._tps)
            else (voice[0], voice[1] if voice[0] == "throttled" else None)
        )
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
    def generation(self, priority: str | None = None) -> Iterator[None]:
        """Mark a generation of class `priority` as running: it holds the model and can take steps
        (the engine enters this via `running()` once it has the model; waiting for it is not running)."""
        self._generations += 1
        self._by_class[priority] += 1
        try:
            yield
        finally:
            self._generations -= 1
            self._by_class[priority] -= 1
            self._wake()

    running = generation  # the engine's optional Gate hook

    def blocks(self, phase: str, priority: str | None = None) -> bool:
        """Whether `wait(phase, priority)` would park now (the engine's optional Gate hook: it
        finishes queued GPU work before a park). Throttling paces decode steps, never parks."""
        return self.mode_for(priority)[0] == "paused"

    async def wait(self, phase: str, priority: str | None = None) -> None:
        """Return when the next step of a generation of class `priority` may run: park while its
        mode is paused, pace decode while throttled."""
        while True:
            mode, tps = self.mode_for(priority)
            if mode == "paused":
                await self._park(priority)
                continue
            now = self._clock()
            if mode == "throttled" and phase == "decode" and tps:
                interval = 1.0 / tps
                slot = self._next_slot if self._next_slot > now - interval else now
                if now < slot:
                    with anyio.move_on_after(slot - now):
                        await self._wait_changed()
                    self._throttle_wait_s += self._clock() - now
                    continue
                self._next_slot = slot + interval
            self._steps[phase] = self._steps.get(phase, 0) + 1
            self._last_phase = phase
            if self._mode == "paused":
                self._passed += 1
            return

    async def _wait_changed(self) -> None:
        if self._changed is None:
            self._changed = anyio.Event()
        await self._changed.wait()

    async def _park(self, priority: str | None) -> None:
        self._parked += 1
        if not self._pause_reacted and self._pause_cause_ts is not None:
            self._pause_reacted = True
            reaction_ms = (self._clock() - self._pause_cause_ts) * 1000.0
            self._reactions.append(reaction_ms)
            log.info(
                "decode_parked",
                reasons=sorted(self._reasons),
                reaction_ms=round(reaction_ms, 3),
                after=self._last_phase,
                priority=priority,
            )
        self._wake()
        try:
            while self.mode_for(priority)[0] == "paused":
                await self._wait_changed()
        finally:
            self._parked -= 1
            self._wake()

    # -- the voice path's side --------------------------------------------------------------
    @property
    def parked(self) -> bool:
        """True when no generation the gate holds can take a step: none is running, or the gate is
        paused and every generation it holds is parked (a voice generation it lets pass is not
        waited for: holding the voice path back for the voice turn's own reply helps nobody)."""
        if self._generations == 0 and self._parked == 0:
            return True
        if self._mode != "paused":
            return False
        held = sum(n for cls, n in self._by_class.items() if n > 0 and self.mode_for(cls)[0] == "paused")
        return self._parked >= held

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
            "voice_mode": self.mode_for(VOICE_CLASS)[0],
            "voice_throttle_tps": self.mode_for(VOICE_CLASS)[1],
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
            "passed_steps_total": self._passed,
            "throttle_wait_seconds": round(self._throttle_wait_s, 6),
        }


class BudgetTaker(Protocol):
    """What the arbiter pushes the LLM memory budget to (the model manager)."""

    def apply_budget(self, mb: float | None) -> None:
        """Use `mb` MiB (None: no limit) as the LLM budget from now on."""


class PriorityTaker(Protocol):
    """What the arbiter pushes the request classes to (admission)."""

    def apply_priorities(self, table: PriorityTable) -> None:
        """Serve the classes of `table` from now on."""


class Arbiter:
    """Applies decisions: the decode gate, admission flags, the unload request, the LLM budget
    (to the model manager) and the request classes (to admission)."""

    def __init__(self, gate: DecodeGate, *, on_unload: Callable[[], None] | None = None) -> None:
        self.gate = gate
        """The decode gate the engine awaits."""
        self.decision: Decision | None = None
        """The decision in force."""
        self._on_unload = on_unload
        self._listeners: list[Callable[[Decision], None]] = []
        self._budget_takers: list[BudgetTaker] = []
        self._priority_takers: list[PriorityTaker] = []
        self._evaluated = -1
        self._evaluating = False
        self._again = False

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

    @property
    def prefill_layer_group(self) -> int:
        """Layers between two gate checks inside a prefill chunk for new generations (0: whole chunks)."""
        return self.decision.prefill_layer_group if self.decision else 0

    def add_listener(self, fn: Callable[[Decision], None]) -> None:
        """Call `fn(decision)` after every decision change (admission, model manager, MQTT)."""
        self._listeners.append(fn)

    def attach(self, *, models: BudgetTaker | None = None, admission: PriorityTaker | None = None) -> None:
        """Push every decision's LLM budget to `models` and its request classes to `admission`
        (the decision in force now, then each one that changes them)."""
        if models is not None:
            self._budget_takers.append(models)
            if self.decision is not None:
                models.apply_budget(self.decision.llm_budget_mb)
        if admission is not None:
            self._priority_takers.append(admission)
            if self.decision is not None:
                admission.apply_priorities(self.decision.priorities)

    def apply(self, decision: Decision) -> bool:
        """Put `decision` into force; returns True (and logs one line) if its effect changed.

        A changed LLM budget or priority table is pushed first, whether or not the effect changed."""
        prev, self.decision = self.decision, decision
        if prev is None or prev.llm_budget_mb != decision.llm_budget_mb:
            for taker in self._budget_takers:
                taker.apply_budget(decision.llm_budget_mb)
        if prev is None or (prev.priorities is not decision.priorities and prev.priorities != decision.priorities):
            for ptaker in self._priority_takers:
                ptaker.apply_priorities(decision.priorities)
        if prev is not None and prev.effect() == decision.effect():
            return False
        voice = (decision.voice_gate, decision.voice_throttle_tps)
        if decision.gate == "paused":
            new = decision.pause_reasons - self.gate.reasons
            causes = [f.ts for f in decision.fired if f.reason in new and f.ts is not None]
            self.gate.set_mode(
                "paused", reasons=decision.pause_reasons, cause_ts=min(causes) if causes else None, voice=voice
            )
        elif decision.gate == "throttled":
            assert decision.throttle_tps is not None
            self.gate.set_mode("throttled", tps=decision.throttle_tps, voice=voice)
        else:
            self.gate.open()
        inputs: dict[str, Any] = {}
        for f in decision.fired:
            inputs.update(f.inputs)
        log.info(
            "policy_decision",
            policy=decision.policy,
            rule=",".join(f.rule for f in decision.fired) or "none",
            inputs=inputs,
            action=decision.action_text(),
        )
        if decision.unload_llm and not (prev and prev.unload_llm) and self._on_unload is not None:
            self._on_unload()
        for fn in self._listeners:
            fn(decision)
        return True

    def evaluate_now(self, store: StateStore, get_policy: Callable[[], Policy | None]) -> None:
        """Evaluate the store's snapshot and apply the decision, now (a change published while
        applying, e.g. the engine's stats, is evaluated right after, not recursively)."""
        if self._evaluating:
            self._again = True
            return
        self._evaluating = True
        try:
            while True:
                self._again = False
                version = store.version
                policy = get_policy()
                if policy is not None:
                    decision = evaluate(policy, store.snapshot(), self.decision)
                    store.set_decision(decision)
                    self.apply(decision)
                self._evaluated = version
                if not self._again:
                    return
        finally:
            self._evaluating = False

    def _store_changed(self, store: StateStore, get_policy: Callable[[], Policy | None]) -> None:
        try:
            self.evaluate_now(store, get_policy)
        except Exception as exc:  # the publisher is not to blame: the arbiter's task re-raises it
            log.error("policy_evaluation_failed", error=repr(exc))

    async def run(
        self,
        store: StateStore,
        get_policy: Callable[[], Policy | None],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Evaluate on every change of the store, synchronously inside `publish` (no loop turn
        between an observation and the gate), and when a decision says to (a hold-off ends)."""
        remove = store.add_listener(lambda: self._store_changed(store, get_policy))
        try:
            self.evaluate_now(store, get_policy)
            task_status.started()
            while True:
                at = self.decision.next_eval_at if self.decision else None
                if self._evaluated < store.version or (at is not None and at <= time.monotonic()):
                    self.evaluate_now(store, get_policy)  # a timer, or a listener's evaluation failed
                    continue
                delay = math.inf if at is None else max(0.0, at - time.monotonic())
                with anyio.move_on_after(delay):
                    await store.wait_changed(store.version)
        finally:
            remove()
