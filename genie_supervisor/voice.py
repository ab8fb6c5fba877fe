"""Voice hints: ``{"service": "stt"|"tts", "event": "start"|"stop"}`` from HTTP or MQTT.

``POST /v1/voice/events`` and the MQTT topic ``genie/<node_id>/voice/events`` both call
``VoiceHints.handle``; it validates the payload and publishes a ``VoiceActivity``. A start
that never gets its stop expires in the StateStore after the hint timeout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, cast

from .events import VoiceActivity, VoiceService, now
from .state import StateStore

_KEYS = ("service", "event", "session")
_EVENTS = {"start": True, "stop": False}


class VoiceHints:
    """Turns voice hints into VoiceActivity observations in the store."""

    def __init__(self, store: StateStore, clock: Callable[[], float] = now) -> None:
        self._store = store
        self._clock = clock

    def handle(self, payload: Any, source: str) -> VoiceActivity:
        """Validate `payload` and publish it; raises ValueError with a one-line reason."""
        if not isinstance(payload, dict):
            raise ValueError(f"a voice hint must be a JSON object, got {type(payload).__name__}")
        unknown = sorted(set(payload) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown key {unknown[0]!r}; expected service, event and optionally session")
        service = payload.get("service")
        if service not in ("stt", "tts"):
            raise ValueError(f"service must be 'stt' or 'tts', got {service!r}")
        event = payload.get("event")
        if not isinstance(event, str) or event not in _EVENTS:  # a list or object is not hashable
            raise ValueError(f"event must be 'start' or 'stop', got {event!r}")
        session = payload.get("session")
        if session is not None and not isinstance(session, str):
            raise ValueError(f"session must be a string, got {session!r}")
        activity = VoiceActivity(
            service=cast(VoiceService, service),
            active=_EVENTS[event],
            source=source,
            ts=self._clock(),
            session=session,
            event=f"hint:{event}",
        )
        self._store.publish(activity)
        return activity

    def handle_json(self, raw: bytes | str, source: str) -> VoiceActivity:
        """`handle` for a raw JSON body (an MQTT payload)."""
        try:
            payload = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"a voice hint must be JSON: {exc}") from exc
        return self.handle(payload, source)
