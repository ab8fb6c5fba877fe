"""When state messages go out: changes at once but at most one per topic per interval, plus a refresh.

``render(entities, inputs, topics)`` computes every state and attributes message for a moment;
``StatePublisher`` decides which of them to send: ``changes()`` returns the messages whose payload
differs from what was last sent (a topic sent less than ``min_interval_s`` ago waits, and the
latest value wins), ``refresh()`` returns all of them. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .entity_model import Entity, Inputs, Topics


@dataclass(frozen=True)
class Message:
    """One state message."""

    topic: str
    payload: str
    on_change: bool = True
    """Sent when it changes (False: only with the periodic refresh)."""


def render(entities: Iterable[Entity], inputs: Inputs, topics: Topics) -> dict[str, Message]:
    """Every state and attributes message for `inputs`, by topic."""
    out: dict[str, Message] = {}
    for e in entities:
        if e.state is None:
            continue
        value = e.render(inputs)
        if value is not None:
            topic = topics.state(e.state)
            out[topic] = Message(topic, value, e.on_change)
        attrs = e.render_attributes(inputs)
        if attrs is not None and e.attributes_topic is not None:
            topic = topics.state(e.attributes_topic)
            out[topic] = Message(topic, attrs, e.on_change)
    return out


class StatePublisher:
    """Per-topic rate limit and last-sent memory for one connection."""

    def __init__(self, *, min_interval_s: float = 1.0, clock: Callable[[], float]) -> None:
        self.min_interval_s = min_interval_s
        """Shortest time between two messages on one topic (except for a refresh)."""
        self._clock = clock
        self._sent: dict[str, tuple[str, float]] = {}

    def reset(self) -> None:
        """Forget what was sent (a new connection starts from nothing)."""
        self._sent.clear()

    def forget(self, topic: str) -> None:
        """Forget what was sent on `topic`: its next ``changes()`` sends it at once, even unchanged."""
        self._sent.pop(topic, None)

    def refresh(self, messages: dict[str, Message]) -> list[Message]:
        """Every message, recorded as sent now."""
        now = self._clock()
        for m in messages.values():
            self._sent[m.topic] = (m.payload, now)
        return list(messages.values())

    def changes(self, messages: dict[str, Message]) -> tuple[list[Message], float | None]:
        """Changed messages that may go now, and when the next held-back one may go (None if none)."""
        now = self._clock()
        out: list[Message] = []
        due: float | None = None
        for m in messages.values():
            if not m.on_change:
                continue
            last = self._sent.get(m.topic)
            if last is not None and last[0] == m.payload:
                continue
            if last is not None and now - last[1] < self.min_interval_s:
                at = last[1] + self.min_interval_s
                due = at if due is None else min(due, at)
                continue
            self._sent[m.topic] = (m.payload, now)
            out.append(m)
        return out, due
