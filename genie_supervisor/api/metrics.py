"""Prometheus metrics: one registry per app, read from the daemon's parts (`ApiDeps`) at scrape time.

This module (and prometheus_client) is imported by the first scrape, not by `create_app`: the
daemon's start does not pay for it (`registry_of`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .deps import ApiDeps

STATES = ("unloaded", "loading", "ready", "error")


class SupervisorCollector(Collector):
    """Every genie_* metric, computed from the supervisor's counters when scraped."""

    def __init__(self, deps: ApiDeps) -> None:
        self.deps = deps

    def collect(self) -> Iterator[Metric]:
        deps = self.deps
        yield from self._models(deps)
        yield from self._admission(deps)
        yield from self._gate(deps.gate.metrics())
        yield from self._prompt_cache(deps.prompt_cache())
        voice = CounterMetricFamily("genie_voice_events", "Voice hints handled", labels=["service", "event", "source"])
        for (service, event, source), n in sorted(deps.voice.counts.items()):
            voice.add_metric([service, event, source], n)
        yield voice

    def _models(self, deps: ApiDeps) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "genie_model_state", "1 for the state each model is in", labels=["model", "backend", "state"]
        )
        mem = GaugeMetricFamily(
            "genie_model_memory_bytes", "Planned memory of each model (weights+KV+scratch)", labels=["model"]
        )
        load = GaugeMetricFamily("genie_model_load_seconds", "Duration of the last load", labels=["model"])
        evict = CounterMetricFamily("genie_model_evictions", "Times a model was evicted to make room", labels=["model"])
        flight = GaugeMetricFamily("genie_requests_in_flight", "Requests generating now", labels=["model"])
        reqs = CounterMetricFamily("genie_requests", "Requests finished", labels=["model"])
        tokens = CounterMetricFamily("genie_tokens", "Tokens processed", labels=["model", "kind"])
        prefill = GaugeMetricFamily(
            "genie_prefill_tokens_per_second", "Prefill speed of the last request", labels=["model"]
        )
        decode = GaugeMetricFamily(
            "genie_decode_tokens_per_second", "Decode speed of the last request", labels=["model"]
        )
        for m in deps.models.models.values():
            for s in STATES:
                state.add_metric([m.id, m.kind, s], 1.0 if m.state == s else 0.0)
            if m.plan is not None:
                mem.add_metric([m.id], float(m.plan.total))
            if m.load_seconds is not None:
                load.add_metric([m.id], m.load_seconds)
            evict.add_metric([m.id], m.evictions)
            flight.add_metric([m.id], m.in_flight)
            reqs.add_metric([m.id], m.usage.requests)
            tokens.add_metric([m.id, "prompt"], m.usage.prompt_tokens)
            tokens.add_metric([m.id, "completion"], m.usage.completion_tokens)
            prefill.add_metric([m.id], m.usage.prefill_tps)
            decode.add_metric([m.id], m.usage.decode_tps)
        yield from self._remotes(deps)
        budget = GaugeMetricFamily("genie_llm_budget_bytes", "The LLM memory budget of the decision in force")
        decision = deps.decision()
        if decision is not None and decision.llm_budget_mb is not None:
            budget.add_metric([], decision.llm_budget_mb * 1024 * 1024)
        yield from (state, mem, load, evict, flight, reqs, tokens, prefill, decode, budget)

    def _remotes(self, deps: ApiDeps) -> Iterator[Metric]:
        """backend openai models: whether the remote answered its last probe or request, whether the local
        fallback answers for it, and how often requests moved to the fallback."""
        remotes = [(m.id, m.backend.describe()["remote"]) for m in deps.models.models.values() if m.kind == "openai"]
        if not remotes:
            return
        up = GaugeMetricFamily("genie_remote_up", "1 while the remote server answers", labels=["model", "url"])
        fb = GaugeMetricFamily("genie_remote_fallback", "1 while the local fallback answers for it", labels=["model"])
        moves = CounterMetricFamily("genie_remote_switches", "Times requests moved to the fallback", labels=["model"])
        for mid, r in remotes:
            up.add_metric([mid, r["url"]], 1.0 if r["state"] == "up" else 0.0)
            fb.add_metric([mid], 1.0 if r["serving"] == "fallback" else 0.0)
            moves.add_metric([mid], r["switches"])
        yield from (up, fb, moves)

    def _prompt_cache(self, pc: dict[str, Any]) -> Iterator[Metric]:
        if not pc.get("enabled"):
            return
        events = CounterMetricFamily(
            "genie_prompt_cache_events", "Prompt cache on disk: hits, misses, saves, evictions", labels=["event"]
        )
        for name, key in (("hit", "hits"), ("miss", "misses"), ("save", "saves"), ("evict", "evictions")):
            events.add_metric([name], pc[key])
        rejects = CounterMetricFamily(
            "genie_prompt_cache_rejects", "Cache files refused, per reason", labels=["reason"]
        )
        for reason, n in sorted(pc["reject_reasons"].items()):
            rejects.add_metric([reason], n)
        io = CounterMetricFamily("genie_prompt_cache_io_bytes", "Bytes read and written", labels=["direction"])
        io.add_metric(["read"], pc["bytes_read"])
        io.add_metric(["written"], pc["bytes_written"])
        restored = CounterMetricFamily("genie_prompt_cache_restored_tokens", "Prompt tokens restored from disk")
        restored.add_metric([], pc["restored_tokens"])
        size = GaugeMetricFamily("genie_prompt_cache_bytes", "Bytes of cache files on disk")
        size.add_metric([], pc["bytes"])
        bound = GaugeMetricFamily("genie_prompt_cache_max_bytes", "Bound of the cache files' total size")
        bound.add_metric([], pc["max_bytes"])
        files = GaugeMetricFamily("genie_prompt_cache_files", "Cache files on disk")
        files.add_metric([], pc["files"])
        yield from (events, rejects, io, restored, size, bound, files)

    def _admission(self, deps: ApiDeps) -> Iterator[Metric]:
        adm = deps.admission
        depth = GaugeMetricFamily("genie_queue_depth", "Requests waiting for a slot", labels=["priority"])
        for cls, n in adm.queued_by_class().items():
            depth.add_metric([cls], n)
        slots = GaugeMetricFamily("genie_slots_in_use", "Admission slots held")
        slots.add_metric([], adm.running)
        admitted = CounterMetricFamily("genie_admitted", "Requests that got a slot", labels=["priority"])
        wait = CounterMetricFamily(
            "genie_queue_wait_seconds", "Seconds waited in the queue by admitted requests", labels=["priority"]
        )
        for cls, n in adm.admitted.items():
            admitted.add_metric([cls], n)
            wait.add_metric([cls], adm.wait_sum_s[cls])
        rejected = CounterMetricFamily(
            "genie_rejections", "Requests refused by admission", labels=["priority", "reason"]
        )
        for (cls, reason), n in sorted(adm.rejected.items()):
            rejected.add_metric([cls, reason], n)
        yield from (depth, slots, admitted, wait, rejected)

    def _gate(self, g: dict[str, Any]) -> Iterator[Metric]:
        mode = GaugeMetricFamily("genie_gate_mode", "1 for the decode gate's mode", labels=["mode"])
        for m in ("open", "throttled", "paused"):
            mode.add_metric([m], 1.0 if g["mode"] == m else 0.0)
        pauses = CounterMetricFamily("genie_gate_pauses", "Decode pauses per reason", labels=["reason"])
        for r, n in sorted(g["pauses_total"].items()):
            pauses.add_metric([r], n)
        paused = CounterMetricFamily(
            "genie_gate_paused_seconds", "Seconds decode was paused per reason", labels=["reason"]
        )
        for r, s in sorted(g["paused_seconds"].items()):
            paused.add_metric([r], s)
        steps = CounterMetricFamily("genie_gate_steps", "Steps let through the gate", labels=["phase"])
        for phase, n in sorted(g["steps_total"].items()):
            steps.add_metric([phase], n)
        reaction = GaugeMetricFamily(
            "genie_gate_reaction_ms", "Pause reaction time (observation to parked)", labels=["quantile"]
        )
        for q, key in (("0.5", "reaction_ms_p50"), ("0.99", "reaction_ms_p99")):
            if g.get(key) is not None:
                reaction.add_metric([q], g[key])
        yield from (mode, pauses, paused, steps, reaction)


def registry_for(deps: ApiDeps) -> CollectorRegistry:
    """A new registry whose one collector reads `deps` when scraped."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SupervisorCollector(deps))
    return reg


def registry_of(state: Any) -> CollectorRegistry:
    """The registry of the app whose ``app.state`` is `state` (made by its first scrape, from ``state.deps``)."""
    reg = getattr(state, "metrics_registry", None)
    if reg is None:
        reg = state.metrics_registry = registry_for(state.deps)
    assert isinstance(reg, CollectorRegistry)
    return reg
