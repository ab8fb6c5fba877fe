"""A fake monotonic clock for the parts that accept one (DecodeGate)."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that move only when the test advances them."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        """The time it reads."""

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the time forward by `seconds`."""
        self.now += seconds
