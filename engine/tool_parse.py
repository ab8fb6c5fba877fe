"""Reading tool calls out of a model's output: the scanner behind `engine.tool_calls.ToolSyntax.parse`.

One scanner (`Parser`) serves every syntax; its flags say which forms it reads: wrapper tags around JSON
(``<tool_call>``, llama.cpp's lenient list: ``<function_call>``, ``<tool>``, ``<tools>``, ``<response>``,
``<json>``, ``<xml>``), ``<function=NAME>`` / ``<function name="NAME">``, code fences, ``<|python_tag|>``,
and bare JSON or Python-style calls that run to the end of the output. JSON is decoded with `json`;
Python-style calls are read with `ast` and `ast.literal_eval`, never evaluated. A block that does not hold
well-formed calls is not a call, and the scan goes on past its first character.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["PYTHON_TAG", "Parser", "ToolCall", "line_start"]


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str
    """The function's name, as the model wrote it."""
    arguments: dict[str, Any]
    """Its arguments, decoded from the model's JSON (or Python keyword arguments)."""
    id: str | None = None
    """The call's id: None unless the model wrote one (llama.cpp's generic format does); the API assigns one."""
    arguments_json: str | None = field(default=None, compare=False)
    """The arguments' JSON text as the model wrote it (what the API answers, streamed or not); None when the
    model wrote none (Python-style calls, missing arguments): the API writes `arguments` as JSON."""


_DECODER = json.JSONDecoder()
_WS = " \t\r\n"
_MAX_PY = 100_000
"""Longest Python-style call text handed to `ast` (a model's output is bounded anyway)."""
_WRAPPER_TAGS = ("tool_call", "function_call", "tools", "tool", "response", "json", "xml")
_TAG = re.compile(r"<(" + "|".join(_WRAPPER_TAGS) + r")>", re.IGNORECASE)
_FUNCTION_TAG = re.compile(r"""<function(?:=([^>\s]+)|\s+name\s*=\s*"([^"]+)"\s*)>""", re.IGNORECASE)
_FENCE = re.compile(r"```([A-Za-z_]*)[ \t]*\r?\n?")
PYTHON_TAG = "<|python_tag|>"


def _json_at(text: str, i: int) -> tuple[Any, int] | None:
    """The JSON value starting at `i` (after whitespace) and where it ends, or None."""
    while i < len(text) and text[i] in _WS:
        i += 1
    if i >= len(text) or text[i] not in "{[":
        return None
    try:
        return _DECODER.raw_decode(text, i)
    except (ValueError, RecursionError):
        return None


def _call(obj: Any, *, loose: bool) -> ToolCall | None:
    """A call from ``{"name", "arguments"|"parameters"}`` (or OpenAI's ``{"function": {...}}``); `loose`
    (inside a tag that says "this is a call") lets the arguments be missing."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None and loose and "arguments" not in obj and "parameters" not in obj:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    call_id = obj.get("id")
    return ToolCall(name=name, arguments=args, id=call_id if isinstance(call_id, str) and call_id else None)


def _calls(value: Any, *, loose: bool) -> list[ToolCall] | None:
    """One call, a JSON list of calls, or llama.cpp's generic ``{"tool_calls": [...]}`` /
    ``{"tool_call": {...}}``; None when any of them is not a call. `loose` (inside a tag): an empty list is
    no call (SmolLM2's ``<tool_call>[]</tool_call>``)."""
    if isinstance(value, dict) and len(value) == 1:
        if isinstance(value.get("tool_calls"), list):
            value = value["tool_calls"]
        elif isinstance(value.get("tool_call"), dict):
            value = value["tool_call"]
    items = value if isinstance(value, list) else [value]
    calls = [_call(v, loose=loose) for v in items]
    if (not items and not (loose and isinstance(value, list))) or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _python_calls(src: str) -> list[ToolCall] | None:
    """Calls written as Python (``f(a=1)``, one a line, or a list ``[f(a=1), g()]``): keyword arguments with
    literal values only; Llama's ``python.call(code=...)`` names the tool "python". None for anything else."""
    src = src.strip()
    if not src or len(src) > _MAX_PY:
        return None
    try:
        tree = ast.parse(src, mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes: list[ast.expr] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return None
        value = stmt.value
        nodes.extend(value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value])
    calls: list[ToolCall] = []
    for node in nodes:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        if name.endswith(".call") and name.count(".") == 1:
            name = name[: -len(".call")]
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        calls.append(ToolCall(name=name, arguments=args))
    return calls or None


_Match = tuple[list[ToolCall], int]
"""The calls a block holds and where the block ends."""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _close(text: str, i: int, closer: str) -> int | None:
    """The end of `closer` at `i` (after whitespace), or the text's end when only whitespace is left
    (a model that stopped before writing it); None otherwise."""
    i = _skip_ws(text, i)
    if text[i : i + len(closer)].lower() == closer.lower():
        return i + len(closer)
    return len(text) if i >= len(text) else None


def _tag_block(text: str, i: int) -> _Match | None:
    """``<tool_call>`` (or another wrapper tag) around one call or a JSON list of calls."""
    m = _TAG.match(text, i)
    if m is None:
        return None
    got = _json_at(text, m.end())
    if got is None:
        return None
    calls = _calls(got[0], loose=True)
    end = _close(text, got[1], f"</{m.group(1)}>")
    return None if calls is None or end is None else (calls, end)


def _function_block(text: str, i: int) -> _Match | None:
    """``<function=NAME>{args}</function>`` or ``<function name="NAME">{args}</function>``."""
    m = _FUNCTION_TAG.match(text, i)
    if m is None:
        return None
    got = _json_at(text, m.end())
    if got is None or not isinstance(got[0], dict):
        return None
    end = _close(text, got[1], "</function>")
    raw = text[_skip_ws(text, m.end()) : got[1]]
    return (
        None if end is None else ([ToolCall(name=m.group(1) or m.group(2), arguments=got[0], arguments_json=raw)], end)
    )


@dataclass(frozen=True, kw_only=True)
class Parser:
    """The scanner every syntax shares; the flags say which forms it reads."""

    tags: bool
    fences: frozenset[str]
    python_fences: frozenset[str]
    python_tag: bool
    bare_json: bool
    bare_python: bool
    separators: str

    # A block at `i`: (calls, end) or None.
    def block(self, text: str, i: int) -> _Match | None:
        c = text[i]
        if c == "<":
            if self.python_tag and text.startswith(PYTHON_TAG, i):
                return self.python_tag_block(text, i + len(PYTHON_TAG))
            if self.tags:
                return _tag_block(text, i) or _function_block(text, i)
            return None
        if c == "`":
            return self.fence_block(text, i)
        if c in "{[" and line_start(text, i):
            return self.tail(text, i)
        return None

    def fence_block(self, text: str, i: int) -> _Match | None:
        m = _FENCE.match(text, i)
        if m is None:
            return None
        lang = m.group(1).lower()
        start = m.end()
        close = text.find("```", start)
        inner_end = len(text) if close < 0 else close
        end = len(text) if close < 0 else close + 3
        if lang in self.python_fences:
            calls = _python_calls(text[start:inner_end])
            return None if calls is None else (calls, end)
        if lang not in self.fences:
            return None
        j = _skip_ws(text, start)
        inner: _Match | None = None
        if self.tags and j < len(text) and text[j] == "<":
            inner = _tag_block(text, j) or _function_block(text, j)
        elif (got := _json_at(text, j)) is not None:
            calls = _calls(got[0], loose=False)
            inner = None if calls is None else (calls, got[1])
        if inner is None or _skip_ws(text, inner[1]) != inner_end:
            return None
        return inner[0], end

    def python_tag_block(self, text: str, i: int) -> _Match | None:
        """After ``<|python_tag|>``: JSON calls separated by ``;``, or Python-style calls, to the end."""
        return self.tail(text, i, strict=False) or self.python_tail(text, i)

    def python_tail(self, text: str, i: int) -> _Match | None:
        calls = _python_calls(text[i:])
        return None if calls is None else (calls, len(text))

    def tail(self, text: str, i: int, *, strict: bool = True) -> _Match | None:
        """Bare calls that run to the end of the output: JSON objects (or lists of them) separated by
        whitespace or `separators`; for Gemma, a Python list of calls."""
        if self.bare_python and text[_skip_ws(text, i) : _skip_ws(text, i) + 1] == "[":
            got = self.python_tail(text, i)
            if got is not None:
                return got
        if not self.bare_json and strict:
            return None
        calls: list[ToolCall] = []
        j = i
        while True:
            j = _skip_ws(text, j)
            if j >= len(text):
                return (calls, j) if calls else None
            got = _json_at(text, j)
            if got is None:
                return None
            found = _calls(got[0], loose=False)
            if found is None:
                return None
            calls.extend(found)
            j = _skip_ws(text, got[1])
            if j < len(text) and text[j] in self.separators:
                j += 1

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []
        pieces: list[str] = []
        pos = 0  # start of the content not yet taken
        i = 0
        after_call = False
        while i < len(text):
            c = text[i]
            got = self.block(text, i) if c in "<`{[" else None
            if got is None:
                i += 1
                continue
            before = text[pos:i]
            pieces.append(before.lstrip(_WS) if after_call else before)
            pieces[-1] = pieces[-1].rstrip(_WS)
            calls.extend(_with_raw_arguments(text, i, got[1], got[0]))
            pos = i = got[1]
            after_call = True
        if not after_call:
            return text, []
        rest = text[pos:].lstrip(_WS)
        pieces.append(rest)
        return "\n".join(p for p in pieces if p), calls


_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*(?=[{"])')


def _with_raw_arguments(text: str, start: int, end: int, calls: list[ToolCall]) -> list[ToolCall]:
    """`calls` of the block text[start:end], each with the JSON text of its arguments as written: the value of
    the first ``"arguments"``/``"parameters"`` key after the previous call's that decodes to them (a JSON
    string holding the object counts: its content is the text)."""
    out: list[ToolCall] = []
    pos = start
    for call in calls:
        if call.arguments_json is None:
            for m in _ARGS_KEY.finditer(text, pos, end):
                got = _json_at(text, m.end()) if text[m.end()] == "{" else _string_at(text, m.end())
                if got is None:
                    continue
                value, stop = got
                raw = value if isinstance(value, str) else text[m.end() : stop]
                if (json.loads(value) if isinstance(value, str) else value) == call.arguments:
                    call = replace(call, arguments_json=raw)
                    pos = stop
                    break
        out.append(call)
    return out


def _string_at(text: str, i: int) -> tuple[str, int] | None:
    """A JSON string at `i` holding a JSON object's text (arguments written as a string), or None."""
    try:
        value, stop = _DECODER.raw_decode(text, i)
        return (value, stop) if isinstance(value, str) and isinstance(json.loads(value), dict) else None
    except (ValueError, RecursionError):
        return None


def line_start(text: str, i: int) -> bool:
    """Whether only spaces stand between `i` and the start of its line."""
    j = i
    while j > 0 and text[j - 1] in " \t":
        j -= 1
    return j == 0 or text[j - 1] == "\n"
