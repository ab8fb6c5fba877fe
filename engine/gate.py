"""What the engine needs from a decode gate (the supervisor's DecodeGate implements it)."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

Phase = Literal["prefill", "decode"]


@runtime_checkable
class Gate(Protocol):
    """Awaited by the engine before every decode step and between prefill chunks."""

    async def wait(self, phase: Phase) -> None:
        """Return when the next step may run; block (parked) while paused, pace while throttled."""
        ...


# A gate may also offer `running() -> ContextManager`: the engine enters it while a generation
# holds the model (not while it waits for it), so the gate knows which generations can step;
# and `blocks(phase) -> bool`: whether `wait(phase)` would park now. With it the engine keeps a
# prefill piece queued on the device while the gate stays open and waits for it only before a
# park; without it the engine waits for every piece (safe, a little slower on a GPU).


class OpenGate:
    """A gate that never waits (the engine's default)."""

    async def wait(self, phase: Phase) -> None:
        return None

    def blocks(self, phase: Phase) -> bool:
        return False
