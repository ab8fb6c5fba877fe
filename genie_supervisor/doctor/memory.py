"""The doctor's model checks: the GGUF file the config names and its memory plan.

`check_model` opens the model as the daemon would (through an injectable `OpenModel`), plans its
memory for the configured context length, KV type and backend, and `check_memory` compares that
plan with the policy's LLM budget, the box's MemTotal and its MemAvailable; when the plan is over
budget, `largest_ctx_within` finds the largest power-of-two context that would fit, for the fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from engine.errors import EngineError
from engine.model import MemoryPlan, plan_memory
from engine.options import EngineOptions
from engine.spec import read_spec

from ..config import Config
from ..events import TelemetrySample
from ..policy import Policy
from .checks import Check, MiB

OpenModel = Callable[[str], object]
"""Reads a GGUF header (engine.open_model_file)."""


def _plan(
    gf: Any, n_ctx: int, kv_dtype: str, quantized: bool = False, backend: str | None = None, chunk: int | None = None
) -> MemoryPlan:
    return plan_memory(
        gf,
        read_spec(gf),
        n_ctx,
        kv_dtype,
        quantized=quantized,
        backend=backend,
        options=EngineOptions(prefill_chunk=chunk),
    )


def _resolved(backend: str) -> str | None:
    """The backend `auto` (or a name) resolves to here, None when none is usable."""
    from engine.backends import resolve_backend

    try:
        return resolve_backend(backend)
    except ValueError:
        return None


def weights_stay_quantized(backend: str) -> bool:
    """Whether the configured backend keeps weights in their GGUF blocks (the daemon's plan does the same)."""
    from engine.backends import resolve_backend

    try:
        return resolve_backend(backend) == "native"
    except ValueError:
        return False


def largest_ctx_within(
    gf: object,
    kv_dtype: str,
    budget_mb: float,
    start: int,
    quantized: bool = False,
    backend: str | None = None,
    chunk: int | None = None,
) -> int | None:
    """The largest power-of-two context (>= 128, below `start`) whose plan fits, None if none does."""
    n = start // 2
    while n >= 128:
        if _plan(gf, n, kv_dtype, quantized, backend, chunk).total / MiB <= budget_mb:
            return n
        n //= 2
    return None


def check_model(cfg: Config, policy: Policy, sample: TelemetrySample | None, open_model: OpenModel) -> list[Check]:
    """The default model's file (the first loaded at the start: resident, else the first listed)
    and its memory plan against the policy's budget and the box's memory."""
    eng = cfg.engine
    entries = [e for e in cfg.model_entries().values() if (e.backend or cfg.backend) == "builtin"]
    entry = next((e for e in entries if e.resident), entries[0] if entries else None)
    if entry is None or entry.path is None:
        return [Check("model", "ok", "none configured: the daemon runs without an LLM")]
    path = entry.path
    n_ctx, kv_dtype = entry.n_ctx or eng.n_ctx, entry.kv_dtype or eng.kv_dtype
    if not os.path.isfile(path):
        return [
            Check(
                "model",
                "fail",
                f"{path}: not found",
                "genie-supervisor models fetch smollm2 (or gemma3) --cache-dir "
                "/var/cache/genie-supervisor/models, or point engine.model at your GGUF",
            )
        ]
    if not os.access(path, os.R_OK):
        return [
            Check(
                "model",
                "fail",
                f"{path}: not readable by this user",
                "chmod a+r the file (the daemon runs as user genie)",
            )
        ]
    try:
        gf = open_model(path)
        spec = read_spec(gf)  # type: ignore[arg-type]
    except (EngineError, OSError, ValueError) as exc:
        return [
            Check(
                "model",
                "fail",
                f"{path}: {exc}",
                "use a GGUF of a supported architecture (llama, qwen2, qwen3, gemma3; docs/engine.md)",
            )
        ]
    size_mb = os.path.getsize(path) / MiB
    checks = [
        Check(
            "model", "ok", f"{os.path.basename(path)}: {spec.arch}, {spec.n_layers} layers, {size_mb:.0f} MiB on disk"
        )
    ]
    q = weights_stay_quantized(eng.backend)
    b = _resolved(eng.backend)
    chunk = policy.voice.prefill_chunk_tokens
    plan = _plan(gf, n_ctx, kv_dtype, q, b, chunk)
    checks.append(
        check_memory(
            plan,
            policy,
            sample,
            fits_ctx=lambda budget: largest_ctx_within(gf, kv_dtype, budget, n_ctx, q, b, chunk),
        )
    )
    checks.append(check_box(cfg, policy, sample, plan))
    return checks


def check_memory(
    plan: MemoryPlan,
    policy: Policy,
    sample: TelemetrySample | None,
    fits_ctx: Callable[[float], int | None] = lambda _budget: None,
) -> Check:
    """A memory plan against the LLM budget (fail: refused at start), MemTotal (fail) and
    MemAvailable (warn: the load would push the voice services into swap)."""
    mem = policy.memory
    total_mb = plan.total / MiB
    detail = (
        f"weights {plan.weights / MiB:.0f} + KV {plan.kv / MiB:.0f} (n_ctx {plan.n_ctx}, {plan.kv_dtype}) + "
        f"scratch {plan.scratch / MiB:.0f} (prefill chunk {plan.chunk}) = {total_mb:.0f} MiB; "
        f"budget {mem.llm_budget_mb:.0f} MiB"
    )
    box_total = sample.mem_total_mb if sample else None
    box_avail = sample.mem_available_mb if sample else None
    if box_total is not None:
        detail += f"; box {box_avail or 0:.0f} of {box_total:.0f} MiB available"
    if total_mb > mem.llm_budget_mb:
        n = fits_ctx(mem.llm_budget_mb)
        fix = (f"set engine.n_ctx to {n} or less, " if n else "") + (
            "use a smaller model, or raise memory.llm_budget_mb in the policy"
        )
        return Check("memory", "fail", f"over budget: {detail}", fix)
    if box_total is not None and total_mb > box_total:
        return Check("memory", "fail", f"larger than the box's memory: {detail}", "use a smaller model")
    reserved = sum(mem.reservations.values())
    if box_total is not None and mem.llm_budget_mb + reserved > box_total:
        return Check(
            "memory",
            "warn",
            f"{detail}; budget + reservations ({reserved:.0f} MiB) exceed MemTotal",
            "lower memory.llm_budget_mb or memory.reservations in the policy",
        )
    if box_avail is not None and total_mb > box_avail:
        return Check(
            "memory",
            "warn",
            f"more than is available now: {detail}",
            "stop something, or start genie-supervisor before the voice services (its unit is ordered Before= them)",
        )
    return Check("memory", "ok", f"fits: {detail}")


VOICE_SERVICES = ("whisper", "piper", "dfn")
"""The services the policy's memory.reservations name, counted in the box when not estimated in the config."""


def check_box(cfg: Config, policy: Policy, sample: TelemetrySample | None, plan: MemoryPlan) -> Check:
    """The whole box's memory: the config's estimates (box.estimates_mb: the OS, Home Assistant,
    ...), the voice services' reservations from the policy, and the LLM (its plan; its budget as
    the worst case) against box.memory_mb (else MemTotal); says what is left. Fails when even the
    plan does not fit, warns when the budget would not."""
    mem = policy.memory
    parts = dict(cfg.box.estimates_mb)
    for name in VOICE_SERVICES:
        if name not in parts and name in mem.reservations:
            parts[name] = mem.reservations[name]
    total = cfg.box.memory_mb or (sample.mem_total_mb if sample else None)
    llm = plan.total / MiB
    others = sum(parts.values())
    text = " + ".join(f"{k} {v:.0f}" for k, v in parts.items())
    text = (text + " + " if text else "") + f"LLM plan {llm:.0f} (budget {mem.llm_budget_mb:.0f})"
    if total is None:
        return Check(
            "box memory", "warn", f"{text} MiB; the box's memory is unknown", "set box.memory_mb in the config"
        )
    left, worst = total - others - llm, total - others - mem.llm_budget_mb
    detail = f"{text} = {others + llm:.0f} of {total:.0f} MiB; left {left:.0f} MiB ({worst:.0f} with the whole budget)"
    if left < 0:
        return Check("box memory", "fail", f"over: {detail}", "use a smaller model or context, or fewer services")
    if worst < 0:
        return Check("box memory", "warn", detail, "lower memory.llm_budget_mb so the budget fits the box")
    return Check("box memory", "ok", detail)
