"""Stop strings: the text of a generation is held back while it could still become one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Holds back text that could still become a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        """The stop strings (empty ones dropped)."""
        self.pending = ""
        """Text held back: it ends with the start of a stop string."""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [self.pending.find(s) for s in self.stops]
        found = [h for h in hits if h >= 0]
        if found:
            out = self.pending[: min(found)]
            self.pending = ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        """The text held back so far (the generation ended without a stop string); nothing stays held."""
        out, self.pending = self.pending, ""
        return out
