"""One configured model as the model manager keeps it: backend, state, memory plan, use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio

from ..config import ModelEntry
from ..errors import AdmissionError, EngineUnavailable, ModelTooLarge
from ..events import EngineStats
from .serving import Backend, Plan, plan_parts_mb, plan_text

MiB = 1024 * 1024


@dataclass
class Usage:
    """Counters of one model (for /metrics)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0

    def record(self, prompt_tokens: int, completion_tokens: int, timings: dict[str, float]) -> None:
        """Count one finished request (llama-server's timings, where it sent them)."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens
        if timings.get("prompt_per_second"):
            self.prefill_tps = float(timings["prompt_per_second"])
        if timings.get("predicted_per_second"):
            self.decode_tps = float(timings["predicted_per_second"])


class ManagedModel:
    """One configured model: its backend, state, plan and use."""

    def __init__(self, model_id: str, entry: ModelEntry, kind: str, backend: Backend) -> None:
        self.id = model_id
        """Id clients use (the key under ``models``)."""
        self.entry = entry
        """Its config."""
        self.kind = kind
        """Backend serving it now: ``builtin``, ``llama_cpp`` or ``openai`` (the fallback once used)."""
        self.backend = backend
        """That backend."""
        self.fell_back = False
        """True when the fallback backend serves it."""
        self.state = "unloaded"
        """``unloaded``, ``loading``, ``ready`` or ``error``."""
        self.error: str | None = None
        """Why the last load failed."""
        self.exc: BaseException | None = None
        self.plan: Plan | None = None
        """Memory plan of the backend in use (known after the first load attempt)."""
        self.in_flight = 0
        """Requests holding a lease."""
        self.waiting = 0
        """Requests waiting for it to become ready."""
        self.draining = False
        """Being emptied for an eviction or unload: new requests wait."""
        self.last_used = 0.0
        """Monotonic time its last request ended (or began)."""
        self.loaded_at: float | None = None
        """When it became ready."""
        self.load_seconds: float | None = None
        """How long the last load took."""
        self.loads = 0
        """Completed loads."""
        self.evictions = 0
        """Times it was evicted to make room."""
        self.usage = Usage()
        """Token counters."""

    @property
    def names(self) -> list[str]:
        """Id and roles."""
        return [self.id, *self.entry.roles]

    @property
    def plan_mb(self) -> float | None:
        """Planned memory in MiB."""
        return self.plan.total / MiB if self.plan else None

    def describe(self) -> dict[str, Any]:
        """For /v1/models, /running, /status."""
        plan = self.plan
        return {
            "id": self.id,
            "roles": list(self.entry.roles),
            "role": self.entry.roles[0] if self.entry.roles else None,
            "backend": self.kind,
            "backend_identity": self.backend.identity(),
            "fallback": self.fell_back,
            "state": self.state,
            "error": self.error,
            "resident": self.entry.resident,
            "group": self.entry.group,
            "priority": self.entry.priority,
            "in_flight": self.in_flight,
            "draining": self.draining,
            "n_ctx": self.backend.n_ctx,
            "memory": None if plan is None else plan_parts_mb(plan),
            "load_seconds": None if self.load_seconds is None else round(self.load_seconds, 3),
            "evictions": self.evictions,
            **self.backend.describe(),
        }


class Lease:
    """A request's hold on a ready model: it is not evicted until the lease ends."""

    def __init__(self, model: ManagedModel) -> None:
        self.model = model
        """The model."""
        self.backend = model.backend
        """Its backend."""


def aggregate_stats(
    ms: list[ManagedModel],
    by_id: dict[str, EngineStats],
    default: ManagedModel,
    queued: int,
    gate_mode: str,
    ready_s: float | None = None,
) -> EngineStats:
    """The daemon's EngineStats over its models: the busiest model's state, totals over all
    (`by_id`: each builtin model's last EngineStats; llama_cpp and openai models count through `usage`;
    the remote fields describe the busy model's remote, else the first openai model's)."""
    host_stats = [by_id.get(m.id) for m in ms]
    busy = [(m, s) for m, s in zip(ms, host_stats, strict=True) if m.in_flight or (s and s.requests_in_flight)]
    ref_m, ref_s = busy[0] if busy else (default, by_id.get(default.id))
    if busy:
        state = ref_s.state if ref_s and ref_s.state not in ("idle", "unloaded") else "decoding"
        if ref_m.kind in _FORWARDED:
            state = "paused" if gate_mode == "paused" else "decoding"
    elif any(m.state == "loading" for m in ms):
        state = "loading"
    elif default.state == "error":
        state = "error"
    elif any(m.state == "ready" for m in ms):
        state = "idle"
    else:
        state = "unloaded"
    loaded = [s for m, s in zip(ms, host_stats, strict=True) if m.state == "ready" and s is not None]
    weights = sum(s.weights_mb or 0 for s in loaded) or None
    kv = sum(s.kv_mb or 0 for s in loaded) or None
    scratch = sum(s.scratch_mb or 0 for s in loaded) or None
    shown = ref_s if ref_s is not None and ref_s.n_ctx is not None else next(iter(loaded), None)
    backend = ref_s.backend if ref_s and ref_m.kind == "builtin" else ref_m.kind
    remote = next((m.backend.describe()["remote"] for m in [ref_m, *ms] if m.kind == "openai"), None)
    return EngineStats(
        state=state,
        model=(ref_s.model if ref_s and ref_s.model else ref_m.id),
        backend=backend,
        decode_tps=ref_s.decode_tps if ref_s else None,
        first_token_ms=ref_s.first_token_ms if ref_s else None,
        tokens_total=sum(s.tokens_total for s in host_stats if s)
        + sum(m.usage.completion_tokens for m in ms if m.kind in _FORWARDED),
        requests_in_flight=sum(m.in_flight for m in ms),
        requests_queued=queued,
        weights_mb=round(weights, 3) if weights else None,
        kv_mb=round(kv, 3) if kv else None,
        rss_mb=ref_s.rss_mb if ref_s else None,
        remote_url=remote["url"] if remote else None,
        remote_model=remote["remote_model"] if remote else None,
        remote_state=(remote["state"] if remote["serving"] == "remote" else "fallback") if remote else None,
        scratch_mb=round(scratch, 3) if scratch else None,
        n_ctx=shown.n_ctx if shown else None,
        kv_dtype=shown.kv_dtype if shown else None,
        ready_s=ready_s,
    )


_FORWARDED = ("llama_cpp", "openai")
"""Backends whose tokens are counted from their requests' usage (no engine stats of ours)."""


def load_error(m: ManagedModel) -> AdmissionError:
    """The request error for a model whose load failed (its own, a too-large plan, or unavailable)."""
    exc = m.exc
    if isinstance(exc, AdmissionError):
        return exc
    return EngineUnavailable(f"model {m.id!r} failed to load: {m.error}")


def next_victim(m: ManagedModel, plan: Plan, models: list[ManagedModel], budget: float | None) -> ManagedModel | None:
    """The model to evict before `m` (planned as `plan`) loads: None when it fits the LLM `budget`
    next to what is loaded (and no member of its swap group is loaded); a loaded group mate first,
    else the idle-before-busy, lowest-priority, least recently used non-resident model. Raises
    ModelTooLarge with the numbers when nothing can make room."""
    need = plan.total / MiB
    detail = plan_text(plan)
    if budget is not None and need > budget:
        raise ModelTooLarge(
            need,
            budget,
            f"model {m.id!r} needs {need:.1f} MiB ({detail}) but the LLM "
            f"budget (policy memory.llm_budget_mb) is {budget:.1f} MiB",
        )
    mates = [
        o
        for o in models
        if o is not m and m.entry.group is not None and o.entry.group == m.entry.group and o.state == "ready"
    ]
    if mates:
        return mates[0]
    used = sum(o.plan_mb or 0 for o in models if o is not m and o.state in ("ready", "loading"))
    if budget is None or used + need <= budget:
        return None
    candidates = [o for o in models if o is not m and o.state == "ready" and not o.entry.resident]
    if not candidates:
        resident = sum(
            o.plan_mb or 0 for o in models if o is not m and o.entry.resident and o.state in ("ready", "loading")
        )
        raise ModelTooLarge(
            need,
            budget,
            f"model {m.id!r} needs {need:.1f} MiB ({detail}); "
            f"{used:.1f} MiB of the {budget:.1f} MiB budget are in use "
            f"({resident:.1f} MiB by resident models, which are never evicted)",
        )
    return min(candidates, key=lambda o: (o.in_flight > 0, o.entry.priority, o.last_used))


NO_HOST: dict[str, Any] = {
    "state": None,
    "model": None,
    "path": None,
    "arch": None,
    "backend": None,
    "n_ctx": None,
    "kv_dtype": None,
    "error": None,
    "memory_plan": None,
}
"""The engine view's keys when no builtin engine host serves the default model (`describe`)."""


async def first_token(backend: Backend) -> None:
    """Ask `backend` for one token of a tiny chat and wait for it (the start-up warm-up)."""
    from engine import SamplingParams

    stream = await backend.generate(
        [{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1, temperature=0.0), "background"
    )
    try:
        async for _ in stream:
            break
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()


def preloads(models: list[ManagedModel]) -> list[ManagedModel]:
    """The models with ``preload`` that load at the start: in each swap group only the first one."""
    groups: set[str] = set()
    out = []
    for m in models:
        if m.entry.preload and (m.entry.group is None or m.entry.group not in groups):
            out.append(m)
            if m.entry.group is not None:
                groups.add(m.entry.group)
    return out
