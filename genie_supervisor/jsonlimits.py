"""Bounded JSON: refuse documents nested deeper than a limit before parsing them.

Python's ``json`` and pydantic recurse once per level, so a body of 100,000 ``[`` raises
RecursionError (an HTTP 500, a crashed MQTT handler). ``check_depth`` scans the raw bytes
without recursion, counting ``[`` and ``{`` outside strings, and raises ``JsonDepthError``
past the limit; ``loads_bounded`` is ``json.loads`` behind that check.

    data = loads_bounded(raw, MAX_DEPTH)    # ValueError (JsonDepthError or JSONDecodeError)
"""

from __future__ import annotations

import json
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64
"""Default limit: no request or event we take is nested more than a few levels."""

_STEP = tuple(1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256))
"""Depth change per byte value."""
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_SQUARE = bytes.maketrans(b"{}", b"[]")


class JsonDepthError(ValueError):
    """A JSON document nested deeper than ``limit`` levels."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        """The most levels allowed."""
        super().__init__(f"JSON nested deeper than {limit} levels")


def _outside_strings(raw: bytes | str) -> bytes:
    """Only the brackets of `raw` that are outside strings.

    Escapes go first (backslash pairs, then backslash-quote), so every remaining quote opens or
    closes a string and the text outside strings is every other piece between quotes. Invalid
    JSON (an unterminated string) gives some brackets; json.loads rejects it afterwards anyway.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(data.split(b'"')[::2]).translate(None, delete=_NOT_BRACKETS)


def max_depth(raw: bytes | str) -> int:
    """The deepest nesting of arrays and objects in `raw` (0 for a scalar); no recursion."""
    return max(accumulate(map(_STEP.__getitem__, _outside_strings(raw))), default=0)


def check_depth(raw: bytes | str, limit: int = MAX_DEPTH) -> None:
    """Raise JsonDepthError if `raw` nests arrays/objects deeper than `limit` levels.

    Each round deletes the innermost ``[]`` pairs, so a document `limit` deep is gone after
    `limit` rounds; each round is one C-speed pass, however wide the document is.
    """
    brackets = _outside_strings(raw).translate(_SQUARE)
    for _ in range(limit):
        if not brackets:
            return
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            break  # unbalanced: invalid JSON, for json.loads to name
        brackets = shorter
    if brackets and max_depth(raw) > limit:
        raise JsonDepthError(limit)


def loads_bounded(raw: bytes | str, limit: int = MAX_DEPTH) -> Any:
    """``json.loads`` that first refuses nesting deeper than `limit` (JsonDepthError, a ValueError)."""
    check_depth(raw, limit)
    return json.loads(raw)
