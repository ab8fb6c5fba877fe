"""What the HTTP routes may use: the daemon's parts they read and call, handed to `create_app`.

    deps = ApiDeps(config=cfg, admission=admission, models=models, gate=gate, voice=voice,
                   policy=lambda: policy, decision=lambda: arbiter.decision, status=status,
                   uptime_s=uptime_s, version=__version__)
    app = create_app(deps)                          # routes read request.app.state.deps

The routes see nothing else of the daemon: a route that needs more gets a new field here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import Request

if TYPE_CHECKING:
    from ..arbiter import DecodeGate
    from ..config import Config
    from ..events import VoiceActivity
    from ..llm.admission import Admission
    from ..llm.manager import ModelManager
    from ..policy import Policy
    from ..state import Decision


class VoiceHintHandler(Protocol):
    """Voice hints as the API uses them: handled per source, and counted for /metrics."""

    counts: dict[tuple[str, str, str], int]
    """(service, start|stop, http|mqtt) -> hints handled."""

    def handle(self, payload: Any, source: str) -> VoiceActivity:
        """Validate `payload` and publish it; raises ValueError with a one-line reason."""
        ...


@dataclass(frozen=True)
class ApiDeps:
    """The parts of the daemon the HTTP routes read and call (nothing else of it reaches them)."""

    config: Config
    """The validated config (``api.*`` limits and defaults, ``http.*`` and the key for the guard)."""
    admission: Admission
    """The priority queue and its slots."""
    models: ModelManager
    """Models: resolve, lease, unload, describe (the engine view /health reports)."""
    gate: DecodeGate
    """The decode gate (mode and reasons in /health, metrics in /metrics)."""
    voice: VoiceHintHandler
    """Voice hints (``POST /v1/voice/events``; counts in /metrics)."""
    policy: Callable[[], Policy]
    """The policy in force now (its name in /health)."""
    decision: Callable[[], Decision | None]
    """The arbiter's decision in force (None before the first): the LLM budget in /metrics."""
    status: Callable[[], dict[str, Any]]
    """The whole state as JSON values (``GET /status``)."""
    uptime_s: Callable[[], float]
    """Seconds the daemon has been running."""
    version: str
    """Package version (in /health)."""


def get_deps(request: Request) -> ApiDeps:
    """The app's dependencies (a FastAPI dependency for routers)."""
    deps: ApiDeps = request.app.state.deps
    return deps
