"""What the HTTP routes may use: the daemon's parts they read and call, handed to `create_app`.

    deps = ApiDeps(config=cfg, admission=admission, models=models, gate=gate, voice=voice,
                   policy=lambda: policy, decision=lambda: arbiter.decision, status=status,
                   uptime_s=uptime_s, version=__version__)
    app = create_app(deps)                          # routes read request.app.state.deps

The routes see nothing else of the daemon: a route that needs more gets a new field here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
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
    from ..ui.feed import UiFeed


class VoiceHintHandler(Protocol):
    """Voice hints as the API uses them: handled per source, and counted for /metrics."""

    counts: dict[tuple[str, str, str], int]
    """(service, start|stop, http|mqtt) -> hints handled."""

    def handle(self, payload: Any, source: str) -> VoiceActivity:
        """Validate `payload` and publish it; raises ValueError with a one-line reason."""
        ...


@dataclass(frozen=True)
class ControlActions:
    """The operator's controls, as Home Assistant has them over MQTT (the same calls), for ``/control/*``
    and the web page (unload is ``POST /unload``)."""

    select_policy: Callable[[str], Awaitable[None]]
    """Put the policy file named by one of ``policy_options()`` in force; ValueError when unknown or rejected."""
    set_llm_enabled: Callable[[bool], Awaitable[None]]
    """Switch the LLM on or off."""
    reload_policy: Callable[[], Awaitable[bool]]
    """Reload the policy file now (as SIGHUP); False when it was rejected (the old one stays)."""
    policy_options: Callable[[], Sequence[str]]
    """The policy files selectable now."""
    active_policy: Callable[[], str | None]
    """The selected policy file's name."""
    llm_enabled: Callable[[], bool]
    """Whether the LLM is switched on."""


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
    controls: ControlActions | None = None
    """Policy select, reload and the LLM switch (``/control/*``); None: those routes answer 503."""
    ui: UiFeed | None = None
    """The web page's live feed (``/ui/events``); None: the stream answers 503."""
    prompt_cache: Callable[[], dict[str, Any]] = lambda: {"enabled": False}
    """The prompt cache on disk: settings and counters (in /status and /metrics)."""


def get_deps(request: Request) -> ApiDeps:
    """The app's dependencies (a FastAPI dependency for routers)."""
    deps: ApiDeps = request.app.state.deps
    return deps
