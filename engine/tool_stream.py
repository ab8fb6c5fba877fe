"""Tool calls streamed as the model writes them: a call's head (its function's name) as soon as the head is
whole, then the JSON text of its arguments fragment by fragment, as OpenAI streams ``delta.tool_calls``.

`CallStream.feed` reads the output so far from where its content ended (the stream holds the rest:
`engine.tool_calls.content_prefix_len`). It follows calls written as JSON objects that name the function
before its arguments, in every syntax `ToolSyntax.parse` reads them: Hermes/Qwen ``<tool_call>`` blocks,
SmolLM2's ``<tool_call>[...]</tool_call>`` list, Llama 3's ``{"name": ..., "parameters": ...}`` (after
``<|python_tag|>`` or not, ``;`` between calls), Gemma's JSON calls, ``<function=NAME>{...}``, one after the
other. Calls it cannot follow as they come (Python-style calls, arguments written before the name, text
between calls) wait for the end.

`CallStream.finish` squares what was streamed with `ToolSyntax.parse` of the whole output: the rest of the
last call's arguments, then the calls not streamed yet, each whole. A streamed call's fragments concatenate
to its `ToolCall.arguments_json`, the text a non-streamed answer carries. A call the model never finished
(``max_tokens`` ran out inside it) stays as it was streamed; the parse of the whole output does not count
it, as a non-streamed answer does not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .tool_parse import ToolCall

__all__ = ["CallDelta", "CallStream"]


@dataclass(frozen=True)
class CallDelta:
    """One step of one streamed call."""

    index: int
    """The call's place in the answer (0, 1, ...)."""
    arguments: str = ""
    """The next fragment of its arguments' JSON text ("" in a head)."""
    name: str | None = None
    """The function's name in the call's first delta (its head); None in the fragments after it."""
    id: str | None = None
    """The call's id in its head (the API sets it); None in the fragments after it."""


_GAP = r"(?:\s|[\[\]},;]|</?[A-Za-z_]+>|<\|python_tag\|>|```[A-Za-z_]*)*"
"""What may stand between the end of the content (or of the last call's arguments) and the next call's head:
whitespace, brackets and separators, tags, Llama's ``<|python_tag|>``, a code fence."""
_NAME = r'"((?:[^"\\\n]|\\.)*)"'
_HEAD = re.compile(
    _GAP
    + r"(?:\{\s*\"name\"\s*:\s*"
    + _NAME
    + r"\s*,\s*\"(?:arguments|parameters)\"\s*:\s*"
    + r"|<function=([^>\s]+)>\s*"
    + r"|<function\s+name\s*=\s*\"([^\"]+)\"\s*>\s*)(?=\{)"
)
"""A call's head, up to the ``{`` its arguments start with."""
_SCALAR = frozenset(" \t\r\n,:-+.0123456789eEtrufalsn")
_PAIR = {"}": "{", "]": "["}


@dataclass
class _Scan:
    """How far a JSON object starting at `start` reaches in the text so far, read once per character."""

    start: int
    pos: int
    stack: list[str] = field(default_factory=list)
    in_string: bool = False
    escaped: bool = False
    end: int | None = None
    """Just past the object's closing brace, once read."""
    bad: bool = False
    """The text cannot be JSON: the call is left to `CallStream.finish`."""

    def feed(self, text: str) -> None:
        """Read `text` (the whole output so far) on from `pos` until the object ends or cannot be JSON."""
        i = self.pos
        while i < len(text) and self.end is None and not self.bad:
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                elif c < " ":
                    self.bad = True
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.stack.append(c)
            elif c in "}]":
                if not self.stack or self.stack.pop() != _PAIR[c]:
                    self.bad = True
                elif not self.stack:
                    self.end = i + 1
            elif c not in _SCALAR:
                self.bad = True
            i += 1
        self.pos = i


@dataclass
class _Streamed:
    name: str
    scan: _Scan
    sent: str = ""
    """The arguments' text streamed so far."""


class CallStream:
    """The calls of one streamed answer, followed as the text grows (`feed`) and squared at the end (`finish`)."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel
        """Several calls may come (else the first call is the only one)."""
        self.calls: list[_Streamed] = []
        self._stuck = False

    def feed(self, text: str, start: int) -> list[CallDelta]:
        """The deltas `text` (the whole output so far) adds; `start`: where the content ended and the held
        text (a call, or what may be one) begins."""
        out: list[CallDelta] = []
        while not self._stuck:
            if self.calls and self.calls[-1].scan.end is None:  # the last call's arguments are being written
                index, call = len(self.calls) - 1, self.calls[-1]
                call.scan.feed(text)
                if call.scan.bad:
                    self._stuck = True
                    break
                upto = call.scan.end or call.scan.pos
                fragment = text[call.scan.start + len(call.sent) : upto]
                if fragment:
                    call.sent += fragment
                    out.append(CallDelta(index, fragment))
                if call.scan.end is None:
                    break
                continue
            if self.calls and not self.parallel:
                break
            at = self.calls[-1].scan.pos if self.calls else start
            m = _HEAD.match(text, at)
            if m is None:
                break  # not yet, or not a call this stream can follow: `finish` decides
            name = _name(m)
            if name is None:
                self._stuck = True
                break
            self.calls.append(_Streamed(name, _Scan(m.end(), m.end())))
            out.append(CallDelta(len(self.calls) - 1, "", name))
        return out

    def finish(self, calls: list[ToolCall]) -> tuple[list[tuple[int, ToolCall]], list[CallDelta]]:
        """Square the streamed calls with `calls` (the whole output's parse): each parsed call with its index
        in the stream, and the deltas still to send (the rest of a streamed call's arguments, then each call
        not streamed yet, head and whole arguments)."""
        matched = 0
        for streamed, call in zip(self.calls, calls, strict=False):
            if call.name != streamed.name or not arguments_text(call).startswith(streamed.sent):
                break
            matched += 1
        out: list[CallDelta] = []
        indexed: list[tuple[int, ToolCall]] = []
        for k, call in enumerate(calls[:matched]):
            rest = arguments_text(call)[len(self.calls[k].sent) :]
            if rest:
                out.append(CallDelta(k, rest))
            indexed.append((k, call))
        for k, call in enumerate(calls[matched:], start=len(self.calls)):
            out += [CallDelta(k, "", call.name), CallDelta(k, arguments_text(call))]
            indexed.append((k, call))
        return indexed, out


def arguments_text(call: ToolCall) -> str:
    """A call's arguments as the API answers them: as the model wrote them, else written as JSON."""
    if call.arguments_json is not None:
        return call.arguments_json
    return json.dumps(call.arguments, ensure_ascii=False)


def _name(m: re.Match[str]) -> str | None:
    if m.group(1) is None:
        return m.group(2) or m.group(3)
    try:
        name = json.loads(f'"{m.group(1)}"')
    except ValueError:
        return None
    return name if isinstance(name, str) and name else None
