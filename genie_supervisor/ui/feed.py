"""The web page's live feed: a timeline sampled from the state store, and the page's view of the daemon.

    feed = UiFeed(store, gate, models, controls)
    await tg.start(feed.run)            # one sample per change, at most 10 a second, at least 1 a second
    async for text in feed.stream():    # server-sent events: a snapshot first, then one update per sample
        ...
    feed.close()                        # every stream ends (the daemon is stopping)

A sample is one moment of the timeline: voice sessions, the gate, decode speed, queue depth,
temperatures, power and available memory. It is encoded once when it is taken and kept in a ring
of the last `window_s` seconds, so a page connecting later gets the minutes before it and ten open
pages cost ten writes of the same bytes. The view (models and their memory plans, the budget,
services, policy, controls, recent requests) is rebuilt per update and sent only when it changed.
Times on the page are wall-clock seconds (the store's monotonic stamps plus one fixed offset).
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskStatus

from ..state import Decision, StateStore

if TYPE_CHECKING:
    from ..api.deps import ControlActions
    from ..arbiter import DecodeGate
    from ..llm.manager import ModelManager

MAX_RATE_HZ = 10.0
"""Samples (and so stream updates) a second at most, however often the store changes."""
IDLE_S = 1.0
"""A sample is taken at least this often, so the timeline moves while nothing changes."""
WINDOW_S = 300.0
"""Seconds of timeline kept for a page that connects (five minutes)."""


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


class UiFeed:
    """Samples the daemon for the web page and streams the samples and the view to every open page."""

    def __init__(
        self,
        store: StateStore,
        gate: DecodeGate,
        models: ModelManager,
        controls: ControlActions | None = None,
        *,
        decision: Callable[[], Decision | None] | None = None,
        window_s: float = WINDOW_S,
        max_rate_hz: float = MAX_RATE_HZ,
    ) -> None:
        self.store = store
        """Where the observations are."""
        self.gate = gate
        """The decode gate as the arbiter set it."""
        self.models = models
        """The models, their roles and memory plans."""
        self.controls = controls
        """The policy choices and the LLM switch (their state is part of the view)."""
        self.min_interval_s = 1.0 / max_rate_hz
        """Least time between two samples."""
        self.subscribers = 0
        """Streams open now."""
        self._decision = decision or (lambda: store.snapshot().decision)
        self._wall0 = time.time() - time.monotonic()
        self._ring: deque[tuple[float, str]] = deque(maxlen=int(window_s * max_rate_hz) + 1)
        self._count = 0
        self._window_s = window_s
        self._sampled: anyio.Event | None = None
        self._poked: anyio.Event | None = None
        self._closed = False
        self._service_since: dict[str, tuple[bool | None, float]] = {}

    # -- recording ----------------------------------------------------------------------------
    def poke(self, *_args: Any) -> None:
        """Something changed (a store or arbiter listener): take a sample soon."""
        if self._poked is not None:
            self._poked.set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Take a sample after every change (at most `MAX_RATE_HZ` a second, at least one every `IDLE_S`)."""
        remove = self.store.add_listener(self.poke)
        task_status.started()
        try:
            while True:
                self._poked = anyio.Event()
                self.sample()
                await anyio.sleep(self.min_interval_s)
                with anyio.move_on_after(max(0.0, IDLE_S - self.min_interval_s)):
                    await self._poked.wait()
        finally:
            remove()

    def sample(self) -> dict[str, Any]:
        """Take one sample now (kept in the ring, streams woken); returns it."""
        snap = self.store.snapshot()
        wall = snap.ts + self._wall0
        eng, tel = snap.engine, snap.telemetry
        running = eng.requests_in_flight if eng else 0
        point = {
            "t": round(wall, 3),
            "stt": snap.voice.stt_sessions,
            "tts": snap.voice.tts_sessions,
            "gate": self.gate.mode,
            "why": sorted(self.gate.reasons),
            "cap": self.gate.throttle_tps,
            "tps": _r(eng.decode_tps, 2) if eng and running else None,
            "queue": eng.requests_queued if eng else 0,
            "run": running,
            "temps": {k: round(v, 1) for k, v in tel.temps_c.items()} if tel else {},
            "power": {k: round(v, 2) for k, v in tel.power_w.items()} if tel else {},
            "mem": _r(tel.mem_available_mb) if tel else None,
        }
        for name, obs in snap.services.items():
            known = self._service_since.get(name)
            if known is None or known[0] != obs.up:
                self._service_since[name] = (obs.up, obs.ts + self._wall0)
        self._ring.append((wall, _dumps(point)))
        self._count += 1
        if self._sampled is not None:
            self._sampled.set()
            self._sampled = None
        return point

    # -- the view -----------------------------------------------------------------------------
    def view(self) -> dict[str, Any]:
        """What the page shows besides the timeline (JSON values; stable while nothing changes)."""
        snap = self.store.snapshot()
        decision = self._decision()
        models = [self._model(m.describe()) for m in self.models.models.values()]
        controls = self.controls
        tel = snap.telemetry
        return {
            "gate": {
                "mode": self.gate.mode,
                "reasons": sorted(self.gate.reasons),
                "throttle_tps": self.gate.throttle_tps,
                "voice_mode": self.gate.mode_for("voice")[0],
            },
            "decision": decision.action_text() if decision else None,
            "voice": {"stt": snap.voice.stt_active, "tts": snap.voice.tts_active},
            "engine": {
                "state": snap.engine.state if snap.engine else None,
                "model": snap.engine.model if snap.engine else None,
            },
            "llm_enabled": controls.llm_enabled() if controls else self.models.enabled,
            "models": models,
            "memory": {
                "budget_mb": decision.llm_budget_mb if decision else None,
                "available_mb": _r(tel.mem_available_mb) if tel else None,
                "total_mb": _r(tel.mem_total_mb) if tel else None,
                "planned_mb": _r(sum((m["memory"] or {}).get("total_mb", 0.0) for m in models if m["loaded"]), 3),
            },
            "services": [self._service(name, obs) for name, obs in sorted(snap.services.items())],
            "policy": {
                "name": snap.policy_name,
                "error": snap.policy_error,
                "options": list(controls.policy_options()) if controls else [],
                "active": controls.active_policy() if controls else None,
            },
            "requests": [self._request(r) for r in reversed(snap.requests)],
        }

    @staticmethod
    def _model(d: dict[str, Any]) -> dict[str, Any]:
        keys = ("id", "roles", "state", "resident", "group", "draining", "in_flight", "memory", "error", "n_ctx")
        return {
            **{k: d.get(k) for k in keys},
            "backend": d.get("backend_identity"),
            "loaded": d.get("state") in ("ready", "loading"),
        }

    def _service(self, name: str, obs: Any) -> dict[str, Any]:
        since = self._service_since.get(name)
        return {
            "name": name,
            "up": obs.up,
            "reason": obs.reason,
            "since": round(since[1], 1) if since else None,
            "rss_mb": _r(obs.rss_mb),
        }

    def _request(self, r: Any) -> dict[str, Any]:
        return {
            "t": round(r.ts + self._wall0, 1),
            "model": r.model,
            "priority": r.priority,
            "finish": r.finish_reason,
            "ttft_ms": r.first_token_ms,
            "tps": r.decode_tps,
            "prompt": r.prompt_tokens,
            "completion": r.completion_tokens,
        }

    # -- streaming ----------------------------------------------------------------------------
    def close(self) -> None:
        """End every stream (the daemon stops; uvicorn would otherwise wait for them)."""
        self._closed = True
        if self._sampled is not None:
            self._sampled.set()

    async def stream(self, *, ping_s: float = 15.0) -> AsyncIterator[str]:
        """Server-sent events: ``snapshot`` (the kept timeline and the view), then one ``update`` per sample
        (new samples, and the view when it changed); a comment line when nothing came for `ping_s`."""
        self.subscribers += 1
        try:
            count = self._count
            now = time.monotonic() + self._wall0
            samples = [text for wall, text in self._ring if wall >= now - self._window_s]
            view = _dumps(self.view())
            yield _event(
                "snapshot",
                f'{{"now":{now:.3f},"window_s":{self._window_s:g},"max_rate_hz":{1 / self.min_interval_s:g},'
                f'"samples":[{",".join(samples)}],"view":{view}}}',
            )
            while not self._closed:
                if self._count == count:
                    if self._sampled is None:
                        self._sampled = anyio.Event()
                    with anyio.move_on_after(ping_s) as scope:
                        await self._sampled.wait()
                    if scope.cancelled_caught:
                        yield ": ping\n\n"
                    continue
                new = min(self._count - count, len(self._ring))
                count = self._count
                ring = self._ring
                fresh = [ring[i][1] for i in range(len(ring) - new, len(ring))]
                current = _dumps(self.view())
                changed = current != view
                view = current
                yield _event("update", f'{{"samples":[{",".join(fresh)}]' + (f',"view":{view}}}' if changed else "}"))
        finally:
            self.subscribers -= 1


def _event(name: str, data: str) -> str:
    """One server-sent event (`data` is one line of JSON)."""
    return f"event: {name}\ndata: {data}\n\n"
