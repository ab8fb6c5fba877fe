"""Commands from Home Assistant: the app's callbacks, and validation of what arrives.

The app hands the bridge an ``MqttCommands``: async callbacks that act, and plain getters that
report the controls' state. ``parse_command`` turns a message on a command topic into a
``Command`` or raises ``CommandError`` (the bridge logs it, publishes it as the last command
error and calls nothing). ``PendingCommands`` holds what waits to run: one command per topic,
the latest value winning, so a burst of toggles never loses its last word.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ..errors import CommandError
from ..jsonlimits import loads_bounded
from .entities import policy_choices
from .entity_model import OFF, ON, PRESS, Inputs


def _none() -> None:
    return None


@dataclass(frozen=True)
class MqttCommands:
    """What Home Assistant's controls call (supplied by the app)."""

    select_policy: Callable[[str], Awaitable[None]]
    """Put the policy file named by one of ``policy_options()`` in force."""
    set_llm_enabled: Callable[[bool], Awaitable[None]]
    """Enable or disable the LLM (requests get 503 while it is disabled)."""
    reload_policy: Callable[[], Awaitable[None]]
    """Reload the policy file now (as SIGHUP does)."""
    unload_model: Callable[[], Awaitable[None]]
    """Unload the loaded model to give its memory back."""
    set_thermal_soft_limit: Callable[[float], Awaitable[None]]
    """Set the thermal soft limit in °C."""
    voice_hint: Callable[[dict[str, Any]], Awaitable[None]]
    """Handle a voice hint (a JSON object); raises ValueError when the hint is invalid."""
    policy_options: Callable[[], Sequence[str]]
    """Choices of the policy select (names the app's ``select_policy`` accepts)."""
    active_policy: Callable[[], str | None] = _none
    """The selected choice; None falls back to the policy name of the snapshot."""
    llm_enabled: Callable[[], bool | None] = _none
    """Whether the LLM is enabled; None falls back to the engine state not being ``disabled``."""
    thermal_soft_limit: Callable[[], float | None] = _none
    """The thermal soft limit in °C, None where unknown."""
    thermal_limit_range: tuple[float, float] = (40.0, 105.0)
    """Lowest and highest thermal soft limit accepted."""


@dataclass(frozen=True)
class Command:
    """A validated command: which callback, with which argument."""

    action: str
    """``select_policy``, ``set_llm_enabled``, ``reload_policy``, ``unload_model``,
    ``set_thermal_soft_limit`` or ``voice_hint``."""
    arg: Any = None
    """The callback's argument (None for the buttons)."""
    topic: str = ""
    """Topic it arrived on (for the refusal, should the callback refuse it)."""
    payload: str = ""
    """What arrived, as text, cut to ``QUOTE_CHARS`` (for the refusal)."""

    async def run(self, commands: MqttCommands) -> None:
        """Call the callback."""
        fn = getattr(commands, self.action)
        if self.action in ("reload_policy", "unload_model"):
            await fn()
        else:
            await fn(self.arg)


COMMAND_PATHS = {
    "policy/set": "select_policy",
    "llm/enabled/set": "set_llm_enabled",
    "policy/reload": "reload_policy",
    "llm/unload": "unload_model",
    "thermal/soft_limit/set": "set_thermal_soft_limit",
    "voice/events": "voice_hint",
}
"""Command topic path under ``<base_topic>/<node_id>/`` -> action."""

MAX_PAYLOAD_BYTES = 4096
"""Longest command payload read; longer ones are refused unread (a voice hint is ~80 bytes)."""
MAX_JSON_DEPTH = 8
"""Deepest nesting of arrays and objects a voice hint may have (a valid one has depth 1)."""
QUOTE_CHARS = 200
"""Most characters of a payload quoted in logs and refusals."""


def quote(payload: bytes) -> str:
    """A payload as text for logs and refusals, cut to ``QUOTE_CHARS``."""
    text = payload[: QUOTE_CHARS * 4].decode("utf-8", "replace")
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "…"


def _text(topic: str, payload: bytes) -> str:
    try:
        return payload.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CommandError(topic, payload, "payload is not UTF-8 text") from None


def parse_command(path: str, topic: str, payload: bytes, inputs: Inputs) -> Command:
    """Validate a message on command topic `path`; raises CommandError."""
    action = COMMAND_PATHS.get(path)
    if action is None:
        raise CommandError(topic, payload, "not a command topic")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise CommandError(topic, payload, f"payload of {len(payload)} bytes; at most {MAX_PAYLOAD_BYTES} are read")
    quoted = quote(payload)
    if action == "voice_hint":
        try:
            hint = loads_bounded(payload, MAX_JSON_DEPTH)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CommandError(topic, payload, f"a voice hint must be JSON: {exc}") from None
        if not isinstance(hint, dict):
            raise CommandError(topic, payload, f"a voice hint must be a JSON object, got {type(hint).__name__}")
        return Command(action, hint, topic, quoted)
    text = _text(topic, payload)
    if action == "select_policy":
        options = policy_choices(inputs) if inputs.policy_options else []
        if text not in options:
            raise CommandError(topic, payload, f"unknown policy {quote(text.encode())!r}; expected one of {options}")
        return Command(action, text, topic, quoted)
    if action == "set_llm_enabled":  # like PRESS, case-insensitive: ON, on, On
        if text.upper() not in (ON, OFF):
            raise CommandError(topic, payload, f"expected {ON} or {OFF}, got {quote(text.encode())!r}")
        return Command(action, text.upper() == ON, topic, quoted)
    if action in ("reload_policy", "unload_model"):  # PRESS in any case (docs/mqtt.md)
        if text.upper() != PRESS:
            raise CommandError(topic, payload, f"expected {PRESS}, got {quote(text.encode())!r}")
        return Command(action, None, topic, quoted)
    low, high = inputs.thermal_limit_range
    try:
        value = float(text)
    except ValueError:
        raise CommandError(topic, payload, f"expected a temperature in °C, got {quote(text.encode())!r}") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise CommandError(
            topic, payload, f"thermal soft limit must be {low:g}-{high:g} °C, got {quote(text.encode())}"
        )
    return Command(action, value, topic, quoted)


class PendingCommands:
    """Commands waiting to run, at most one per topic: a newer command replaces the waiting one.

    The latest value wins and keeps the place in line of the first one still waiting, so commands
    run in the order their topics first became pending. Bounded by the number of command topics:
    nothing is ever dropped.
    """

    def __init__(self) -> None:
        self._waiting: dict[str, Command] = {}
        self._ready = anyio.Event()

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, key: str, cmd: Command) -> bool:
        """Queue `cmd` under `key` (its topic); True when it replaced a waiting command."""
        replaced = key in self._waiting
        self._waiting[key] = cmd
        self._ready.set()
        return replaced

    async def get(self) -> Command:
        """The oldest waiting command (waits for one)."""
        while not self._waiting:
            self._ready = anyio.Event()
            await self._ready.wait()
        key = next(iter(self._waiting))
        return self._waiting.pop(key)
