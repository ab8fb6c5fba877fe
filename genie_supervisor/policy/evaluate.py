"""Policy evaluation: a pure function from (policy, snapshot, previous decision) to a Decision.

No I/O and no clock: the time is ``snapshot.ts``. Hysteresis state (thermal level, memory
thresholds) is read from the previous decision, so calling it twice with the same arguments
gives the same answer. Rules combine as: any pause wins; otherwise the lowest throttle wins;
memory actions add up (unloading implies refusing new requests). The pauses and throttles that
protect the voice path (``VOICE_REASONS``) do not hold a generation of the voice class: the
decision carries that class's own gate mode.
"""

from __future__ import annotations

from ..state import Decision, FiredRule, GateMode, PriorityClass, PriorityTable, Snapshot
from .schema import Policy, PriorityPolicy

VOICE_REASONS = frozenset({"stt", "tts", "stt_unknown"})
"""Reasons that exist to protect the voice path (voice.stt, voice.tts, their hold-offs,
failsafe.stt_unknown): the voice turn's own generation passes them."""


def evaluate(policy: Policy, snapshot: Snapshot, prev: Decision | None = None) -> Decision:
    """Decide what the arbiter should do for `snapshot` under `policy`."""
    if prev is not None and prev.policy != policy.name:
        prev = None  # hysteresis state belongs to the policy that made it
    fired: list[FiredRule] = []
    wake: list[float] = []
    _voice(policy, snapshot, fired, wake)
    temp_known, thermal_level = _thermal(policy, snapshot, prev, fired)
    memory_active = _memory(policy, snapshot, prev, fired)
    _telemetry_failsafe(policy, snapshot, fired, wake, temp_known)

    pauses = frozenset(f.reason for f in fired if f.action == "pause")
    throttles = [f for f in fired if f.action == "throttle"]
    tps = min((f.throttle_tps for f in throttles if f.throttle_tps), default=None)
    gate: GateMode = "paused" if pauses else ("throttled" if tps is not None else "open")
    held = pauses - VOICE_REASONS
    voice_tps = min(
        (f.throttle_tps for f in throttles if f.throttle_tps and f.reason not in VOICE_REASONS), default=None
    )
    voice_gate: GateMode = "paused" if held else ("throttled" if voice_tps is not None else "open")
    actions = {f.action for f in fired}
    contexts = [int(f.inputs["context_tokens"]) for f in fired if f.action == "shrink_context"]
    return Decision(
        ts=snapshot.ts,
        policy=policy.name,
        gate=gate,
        pause_reasons=pauses,
        throttle_tps=tps if gate == "throttled" else None,
        throttle_reasons=frozenset(f.reason for f in throttles) if gate == "throttled" else frozenset(),
        admission="refuse_new" if actions & {"refuse_new", "unload_llm"} else "accept",
        max_context=min(contexts) if contexts else None,
        unload_llm="unload_llm" in actions,
        thermal_level=thermal_level,
        memory_active=memory_active,
        prefill_chunk_tokens=policy.voice.prefill_chunk_tokens,
        prefill_layer_group=policy.voice.prefill_layer_group,
        llm_budget_mb=policy.memory.llm_budget_mb,
        priorities=priority_table(policy.priorities),
        fired=tuple(fired),
        next_eval_at=min((w for w in wake if w > snapshot.ts), default=None),
        voice_passes=frozenset(
            f.reason for f in fired if f.reason in VOICE_REASONS and f.action in ("pause", "throttle")
        ),
        voice_gate=voice_gate,
        voice_throttle_tps=voice_tps if voice_gate == "throttled" else None,
    )


_last_table: tuple[PriorityPolicy, PriorityTable] | None = None


def priority_table(priorities: PriorityPolicy) -> PriorityTable:
    """The policy's request classes as admission applies them (the same object again for the same policy section)."""
    global _last_table
    last = _last_table
    if last is not None and last[0] is priorities:
        return last[1]
    table = PriorityTable(
        classes=tuple(PriorityClass(c.name, c.max_queue, c.max_wait_s) for c in priorities.classes),
        default_class=priorities.default_class,
    )
    _last_table = (priorities, table)
    return table


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 1)


def _voice(policy: Policy, snap: Snapshot, fired: list[FiredRule], wake: list[float]) -> None:
    v = snap.voice
    for svc, active, since, idle, sessions in (
        ("stt", v.stt_active, v.stt_active_since, v.stt_idle_since, v.stt_sessions),
        ("tts", v.tts_active, v.tts_active_since, v.tts_idle_since, v.tts_sessions),
    ):
        rule = policy.voice.stt if svc == "stt" else policy.voice.tts
        if rule.action == "none":
            continue
        if active:
            inputs: dict[str, object] = {"sessions": sessions}
            fired.append(FiredRule(f"voice.{svc}", rule.action, svc, inputs, since, rule.throttle_tps))
            continue
        if idle is None:
            continue
        until = idle + rule.resume_holdoff_ms / 1000.0
        if snap.ts < until:
            inputs = {"holdoff_left_ms": _ms(until - snap.ts)}
            fired.append(FiredRule(f"voice.{svc}.resume_holdoff_ms", rule.action, svc, inputs, idle, rule.throttle_tps))
            wake.append(until)
    fs = policy.failsafe
    if v.stt_unknown and not v.stt_active and fs.stt_unknown != "ignore":
        tps = fs.throttle_tps if fs.stt_unknown == "throttle" else None
        fired.append(
            FiredRule("failsafe.stt_unknown", fs.stt_unknown, "stt_unknown", {"stt_unknown": True}, snap.ts, tps)
        )


def _fresh_telemetry(policy: Policy, snap: Snapshot) -> bool:
    tel = snap.telemetry
    return tel is not None and snap.ts - tel.ts <= policy.failsafe.telemetry_stale_s


def _thermal(policy: Policy, snap: Snapshot, prev: Decision | None, fired: list[FiredRule]) -> tuple[bool, str | None]:
    levels = policy.thermal.levels
    if not levels:
        return True, None
    temp = None
    if _fresh_telemetry(policy, snap):
        assert snap.telemetry is not None
        temps = snap.telemetry.temps_c
        temp = max(temps.values(), default=None) if policy.thermal.sensor == "max" else temps.get(policy.thermal.sensor)
    if temp is None:
        return False, None
    active = -1
    for i, lv in enumerate(levels):
        if temp >= lv.enter_c:
            active = i
    names = [lv.name for lv in levels]
    if prev is not None and prev.thermal_level in names:
        # hysteresis: stay in the previous level (or a cooler one passed on the way up) above leave_c
        for i in range(names.index(prev.thermal_level), active, -1):
            if temp > levels[i].leave_c:
                active = i
                break
    if active < 0:
        return True, None
    lv = levels[active]
    inputs = {"sensor": policy.thermal.sensor, "temp_c": temp, "enter_c": lv.enter_c, "leave_c": lv.leave_c}
    assert snap.telemetry is not None
    fired.append(
        FiredRule(f"thermal.levels[{lv.name}]", lv.action, "thermal", inputs, snap.telemetry.ts, lv.throttle_tps)
    )
    return True, lv.name


def _memory(policy: Policy, snap: Snapshot, prev: Decision | None, fired: list[FiredRule]) -> tuple[int, ...]:
    mem = policy.memory
    if not mem.thresholds or not _fresh_telemetry(policy, snap):
        return ()
    assert snap.telemetry is not None
    avail = snap.telemetry.mem_available_mb
    if avail is None:
        return ()
    outstanding = 0.0
    for name, reserved in mem.reservations.items():
        obs = snap.services.get(name)
        used = (obs.rss_mb or 0.0) if obs is not None and obs.up else 0.0
        outstanding += max(0.0, reserved - used)
    effective = avail - outstanding
    was = set(prev.memory_active) if prev is not None else set()
    active: list[int] = []
    for i, th in enumerate(mem.thresholds):
        limit = th.below_available_mb + (mem.hysteresis_mb if i in was else 0.0)
        if effective < limit:
            active.append(i)
            inputs: dict[str, object] = {
                "mem_available_mb": avail,
                "reserved_mb": outstanding,
                "effective_mb": effective,
                "below_available_mb": th.below_available_mb,
            }
            if th.context_tokens is not None:
                inputs["context_tokens"] = th.context_tokens
            fired.append(FiredRule(f"memory.thresholds[{i}]", th.action, "memory", inputs, snap.telemetry.ts))
    return tuple(active)


def _telemetry_failsafe(
    policy: Policy, snap: Snapshot, fired: list[FiredRule], wake: list[float], temp_known: bool
) -> None:
    fs = policy.failsafe
    needed = bool(policy.thermal.levels or policy.memory.thresholds)
    if not needed:
        return
    if snap.telemetry is not None:
        wake.append(snap.telemetry.ts + fs.telemetry_stale_s + 1e-6)
    grace = snap.started_ts + fs.telemetry_stale_s
    if snap.telemetry is None and snap.ts < grace:
        wake.append(grace + 1e-6)
        return
    if temp_known and _fresh_telemetry(policy, snap):
        return
    if fs.telemetry_unknown == "ignore":
        return
    if snap.telemetry is None:
        inputs: dict[str, object] = {"telemetry": "missing"}
    elif not _fresh_telemetry(policy, snap):
        inputs = {"telemetry_age_s": round(snap.ts - snap.telemetry.ts, 3)}
    else:
        inputs = {"sensor_missing": policy.thermal.sensor}
    tps = fs.throttle_tps if fs.telemetry_unknown == "throttle" else None
    fired.append(
        FiredRule("failsafe.telemetry_unknown", fs.telemetry_unknown, "telemetry_unknown", inputs, snap.ts, tps)
    )
