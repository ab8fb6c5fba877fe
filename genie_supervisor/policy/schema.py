"""The policy file's schema (version 1): what integrators write in ``policies/*.yaml``.

Every model forbids unknown keys and describes every field; cross-field rules (hysteresis,
ordering, contradictory thresholds) live in validators with a one-sentence message that names
the offending key, so ``policy check`` can point at its line.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..state import DEFAULT_LLM_BUDGET_MB, DEFAULT_PRIORITIES
from ..yamlsrc import KeyedValueError

POLICY_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VoiceRule(_Strict):
    """What decode does while one voice service (STT or TTS) is working."""

    action: Literal["pause", "throttle", "none"] = Field(
        "pause", description="pause decode, throttle it to `throttle_tps`, or leave it alone"
    )
    throttle_tps: float | None = Field(
        None, gt=0, le=10000, description="decode cap in tokens/s when action is throttle"
    )
    resume_holdoff_ms: int = Field(
        0, ge=0, le=60000, description="keep the action this long after the service went idle"
    )

    @model_validator(mode="after")
    def _tps_matches_action(self) -> VoiceRule:
        if self.action == "throttle" and self.throttle_tps is None:
            raise KeyedValueError("throttle_tps", "action throttle needs throttle_tps (tokens/s)")
        if self.action != "throttle" and self.throttle_tps is not None:
            raise KeyedValueError("throttle_tps", f"throttle_tps only applies to action throttle, not {self.action}")
        return self


class VoicePolicy(_Strict):
    """How decode yields to the voice path."""

    stt: VoiceRule = Field(
        default_factory=lambda: VoiceRule(action="pause", resume_holdoff_ms=300),
        description="while speech-to-text runs",
    )
    tts: VoiceRule = Field(default_factory=lambda: VoiceRule(action="none"), description="while text-to-speech runs")
    prefill_chunk_tokens: int = Field(
        64, ge=1, le=8192, description="prefill runs in chunks this long with a gate check between chunks"
    )
    prefill_layer_group: int = Field(
        0,
        ge=0,
        le=1024,
        description="0: a gate check between prefill chunks only; G: also between groups of G layers inside a chunk "
        "(a pause then lands within one group; costs prefill speed for small G on the GPU)",
    )
    hint_timeout_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="an STT/TTS start with no stop expires after this (overrides the daemon config)",
    )


class ThermalLevel(_Strict):
    """One thermal level: entered at or above `enter_c`, left at or below `leave_c`."""

    name: str = Field(
        ..., min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$", description="level name (logs, MQTT)"
    )
    enter_c: float = Field(..., ge=-40, le=150, description="enter the level at or above this temperature (°C)")
    leave_c: float = Field(..., ge=-40, le=150, description="leave the level at or below this temperature (°C)")
    action: Literal["throttle", "pause"] = Field(..., description="what decode does in this level")
    throttle_tps: float | None = Field(None, gt=0, le=10000, description="decode cap in tokens/s for action throttle")

    @model_validator(mode="after")
    def _check(self) -> ThermalLevel:
        if self.leave_c >= self.enter_c:
            raise KeyedValueError(
                "leave_c",
                f"leave_c ({self.leave_c:g}) must be below enter_c ({self.enter_c:g}) for hysteresis",
            )
        if self.action == "throttle" and self.throttle_tps is None:
            raise KeyedValueError("throttle_tps", "action throttle needs throttle_tps (tokens/s)")
        if self.action == "pause" and self.throttle_tps is not None:
            raise KeyedValueError("throttle_tps", "throttle_tps only applies to action throttle, not pause")
        return self


class ThermalPolicy(_Strict):
    """Slow down or stop decode when the box is hot, with hysteresis."""

    sensor: str = Field("max", min_length=1, description="telemetry sensor name, or `max` for the hottest sensor")
    levels: list[ThermalLevel] = Field(default_factory=list, description="levels from coolest to hottest")

    @field_validator("levels")
    @classmethod
    def _ordered(cls, levels: list[ThermalLevel]) -> list[ThermalLevel]:
        seen: set[str] = set()
        for i, lv in enumerate(levels):
            if lv.name in seen:
                raise KeyedValueError((i, "name"), f"level name {lv.name!r} is used twice")
            seen.add(lv.name)
            if i == 0:
                continue
            lo = levels[i - 1]
            if lv.enter_c <= lo.enter_c:
                raise KeyedValueError(
                    (i, "enter_c"),
                    f"enter_c ({lv.enter_c:g}) must be above the previous level's enter_c ({lo.enter_c:g}); list levels from coolest to hottest",
                )
            if lv.leave_c < lo.leave_c:
                raise KeyedValueError(
                    (i, "leave_c"),
                    f"leave_c ({lv.leave_c:g}) must not be below the previous level's leave_c ({lo.leave_c:g})",
                )
            if lo.action == "pause" and lv.action == "throttle":
                raise KeyedValueError(
                    (i, "action"), f"a hotter level cannot throttle when the cooler level {lo.name!r} already pauses"
                )
            if lo.action == lv.action == "throttle" and (lv.throttle_tps or 0) > (lo.throttle_tps or 0):
                raise KeyedValueError(
                    (i, "throttle_tps"),
                    f"throttle_tps ({lv.throttle_tps:g}) must not rise above the cooler level's ({lo.throttle_tps:g})",
                )
        return levels


def with_thermal_soft_limit(policy: Policy, limit_c: float) -> Policy:
    """The policy with its first (coolest) thermal level entered at `limit_c`.

    The level keeps its hysteresis width; raises ValueError when the result would break the
    level ordering (e.g. the limit at or above the next level's `enter_c`) or there is no level.
    """
    levels = policy.thermal.levels
    if not levels:
        raise ValueError("the policy has no thermal levels to move")
    first = levels[0]
    width = first.enter_c - first.leave_c
    moved = first.model_copy(update={"enter_c": limit_c, "leave_c": limit_c - width})
    try:
        thermal = ThermalPolicy(sensor=policy.thermal.sensor, levels=[moved, *levels[1:]])
    except ValidationError as exc:
        why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        raise ValueError(f"soft limit {limit_c:g} °C does not fit the policy's thermal levels: {why}") from None
    return policy.model_copy(update={"thermal": thermal})


class MemoryThreshold(_Strict):
    """An action taken while available memory (minus outstanding reservations) is below a level."""

    below_available_mb: float = Field(
        ..., gt=0, le=1_048_576, description="fires while available memory is below this (MiB)"
    )
    action: Literal["refuse_new", "shrink_context", "unload_llm"] = Field(..., description="what to do while it fires")
    context_tokens: int | None = Field(
        None, ge=16, le=1_048_576, description="max context for new requests (shrink_context)"
    )

    @model_validator(mode="after")
    def _check(self) -> MemoryThreshold:
        if self.action == "shrink_context" and self.context_tokens is None:
            raise KeyedValueError("context_tokens", "action shrink_context needs context_tokens")
        if self.action != "shrink_context" and self.context_tokens is not None:
            raise KeyedValueError(
                "context_tokens", f"context_tokens only applies to action shrink_context, not {self.action}"
            )
        return self


class MemoryPolicy(_Strict):
    """The LLM's memory budget and how load is shed when memory runs short."""

    llm_budget_mb: float = Field(
        DEFAULT_LLM_BUDGET_MB, gt=0, le=1_048_576, description="the most the LLM may use: weights + KV + scratch (MiB)"
    )
    reservations: dict[str, float] = Field(
        default_factory=dict,
        description="memory held back for a service (MiB); what it already uses counts against its reservation",
    )
    hysteresis_mb: float = Field(
        128, ge=0, le=65536, description="a threshold stops firing only above below_available_mb + this"
    )
    thresholds: list[MemoryThreshold] = Field(
        default_factory=list, description="from mildest (highest) to most severe (lowest)"
    )

    @field_validator("reservations")
    @classmethod
    def _positive(cls, res: dict[str, float]) -> dict[str, float]:
        for name, mb in res.items():
            if mb < 0:
                raise KeyedValueError(name, f"a reservation cannot be negative (got {mb:g})")
        return res

    @field_validator("thresholds")
    @classmethod
    def _ordered(cls, ths: list[MemoryThreshold]) -> list[MemoryThreshold]:
        for i in range(1, len(ths)):
            hi, lo = ths[i - 1], ths[i]
            if lo.below_available_mb >= hi.below_available_mb:
                raise KeyedValueError(
                    (i, "below_available_mb"),
                    f"below_available_mb ({lo.below_available_mb:g}) must be lower than the previous threshold's ({hi.below_available_mb:g}); list thresholds from mildest to most severe",
                )
        smallest: int | None = None
        for i, t in enumerate(ths):
            if t.context_tokens is None:
                continue
            if smallest is not None and t.context_tokens > smallest:
                raise KeyedValueError(
                    (i, "context_tokens"),
                    f"context_tokens ({t.context_tokens}) must not grow as memory gets lower (a milder threshold allows only {smallest})",
                )
            smallest = t.context_tokens
        return ths


class RequestClass(_Strict):
    """A class of requests; classes listed first win admission."""

    name: str = Field(
        ..., min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$", description="class name requests carry"
    )
    max_queue: int = Field(8, ge=0, le=10000, description="requests of this class that may wait; more are refused")
    max_wait_s: float = Field(30, gt=0, le=3600, description="a queued request is refused after waiting this long")


class PriorityPolicy(_Strict):
    """Admission order between request classes."""

    classes: list[RequestClass] = Field(
        default_factory=lambda: [
            RequestClass(name=c.name, max_queue=c.max_queue, max_wait_s=c.max_wait_s)
            for c in DEFAULT_PRIORITIES.classes
        ],
        description="highest priority first",
    )
    default_class: str = Field(DEFAULT_PRIORITIES.default_class, description="class of requests that name none")

    @model_validator(mode="after")
    def _check(self) -> PriorityPolicy:
        names = [c.name for c in self.classes]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise KeyedValueError(("classes", i, "name"), f"class name {n!r} is used twice")
        if self.default_class not in names:
            raise KeyedValueError(
                "default_class", f"default_class {self.default_class!r} is not one of the classes ({', '.join(names)})"
            )
        return self


class FailsafePolicy(_Strict):
    """What to do when a signal the policy relies on is unknown."""

    stt_unknown: Literal["pause", "throttle", "ignore"] = Field(
        "ignore", description="when a watched STT service's state is unknown (watcher lost it)"
    )
    telemetry_unknown: Literal["pause", "throttle", "ignore"] = Field(
        "ignore", description="when telemetry is missing, stale, or lacks the thermal sensor"
    )
    throttle_tps: float = Field(5, gt=0, le=10000, description="decode cap for the throttle actions above (tokens/s)")
    telemetry_stale_s: float = Field(10, gt=0, le=3600, description="telemetry older than this counts as unknown")


class Policy(_Strict):
    """A whole policy file."""

    version: Literal[1] = Field(..., description="schema version of this file (1)")
    name: str = Field(..., min_length=1, max_length=64, description="policy name (logs, MQTT, /status)")
    description: str = Field("", description="free text for people")
    voice: VoicePolicy = Field(default_factory=VoicePolicy, description="yielding to the voice path")
    thermal: ThermalPolicy = Field(default_factory=ThermalPolicy, description="thermal levels")
    memory: MemoryPolicy = Field(default_factory=MemoryPolicy, description="memory budget and shedding")
    priorities: PriorityPolicy = Field(default_factory=PriorityPolicy, description="request classes")
    failsafe: FailsafePolicy = Field(default_factory=FailsafePolicy, description="unknown signals")


def builtin_policy() -> Policy:
    """The policy used when the config names no file: the schema's defaults (voice rules only)."""
    return Policy(version=1, name="builtin", description="schema defaults: pause decode while STT runs")
