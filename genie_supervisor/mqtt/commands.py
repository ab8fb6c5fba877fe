"""Commands from Home Assistant: the app's callbacks, and validation of what arrives.

The app hands the bridge an ``MqttCommands``: async callbacks that act, and plain getters that
report the controls' state. ``parse_command`` turns a message on a command topic into a
``Command`` or raises ``CommandError`` (logged and ignored by the bridge: nothing is called).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SupervisorError
from .entities import OFF, ON, PRESS, Inputs, policy_choices


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


class CommandError(SupervisorError):
    """A command payload that is not valid: it is logged and ignored."""

    def __init__(self, topic: str, payload: bytes, message: str) -> None:
        self.topic = topic
        """Command topic it arrived on."""
        self.payload = payload
        """What arrived (for the log)."""
        self.message = message
        """What is wrong and what was expected."""
        super().__init__(f"{topic}: {message}")


@dataclass(frozen=True)
class Command:
    """A validated command: which callback, with which argument."""

    action: str
    """``select_policy``, ``set_llm_enabled``, ``reload_policy``, ``unload_model``,
    ``set_thermal_soft_limit`` or ``voice_hint``."""
    arg: Any = None
    """The callback's argument (None for the buttons)."""

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
    if action == "voice_hint":
        try:
            hint = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CommandError(topic, payload, f"a voice hint must be JSON: {exc}") from None
        if not isinstance(hint, dict):
            raise CommandError(topic, payload, f"a voice hint must be a JSON object, got {type(hint).__name__}")
        return Command(action, hint)
    text = _text(topic, payload)
    if action == "select_policy":
        options = policy_choices(inputs) if inputs.policy_options else []
        if text not in options:
            raise CommandError(topic, payload, f"unknown policy {text!r}; expected one of {options}")
        return Command(action, text)
    if action == "set_llm_enabled":
        if text.upper() not in (ON, OFF):
            raise CommandError(topic, payload, f"expected {ON} or {OFF}, got {text!r}")
        return Command(action, text.upper() == ON)
    if action in ("reload_policy", "unload_model"):
        if text.upper() != PRESS:
            raise CommandError(topic, payload, f"expected {PRESS}, got {text!r}")
        return Command(action)
    low, high = inputs.thermal_limit_range
    try:
        value = float(text)
    except ValueError:
        raise CommandError(topic, payload, f"expected a temperature in °C, got {text!r}") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise CommandError(topic, payload, f"thermal soft limit must be {low:g}-{high:g} °C, got {text}")
    return Command(action, value)
