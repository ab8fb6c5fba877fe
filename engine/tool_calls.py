"""Tool calls in a model's own words: the call syntax a chat template teaches, parsed back from the output,
and the llguidance Lark grammar that forces one when a request says ``tool_choice: required`` or names a tool.

Three call syntaxes (four names), picked by `tool_syntax` from markers in the template source:

- ``hermes`` (Qwen2.5, Qwen3, SmolLM3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  several in a row for parallel calls. ``fallback`` is the same syntax under its own name, for templates that
  know no tools: `fallback_tools_prompt` teaches it in the system message.
- ``llama3`` (Llama 3.1 / 3.2 / 3.3): bare ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``; the built-in ``<|python_tag|>python.call(code="...")`` too.
- ``gemma`` (Gemma 3 has no tool tokens; it gets the fallback prompt): everything ``hermes`` reads, plus
  Gemma's own habits: the Python list ``[f(a=1), g()]`` and ``{"name": ..., "parameters": {...}}`` of Google's
  function-calling guide, and the ``tool_code`` code block of Google's Gemma cookbook.

`ToolSyntax.parse` never raises: text that is not a well-formed call (bad JSON, positional Python arguments)
stays content. Python-style calls are read with `ast` and `ast.literal_eval`, never evaluated. A stream sends
the first `content_prefix_len` characters of the output as content and holds the rest (a call may be starting)
until `parse` reads the whole output. `ToolSyntax.grammar` writes the syntax the prompt taught (Gemma's is
Hermes, since the fallback prompt teaches that); the API checks it with `engine.constrain`.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import jinja2
from jinja2 import nodes

from .errors import TemplateError
from .template_sandbox import _ENV

__all__ = [
    "ToolCall",
    "ToolSyntax",
    "content_prefix_len",
    "fallback_tools_prompt",
    "tool_choice_name",
    "template_supports_tools",
    "tool_syntax",
    "validate_tools",
]


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str
    """The function's name, as the model wrote it."""
    arguments: dict[str, Any]
    """Its arguments, decoded from the model's JSON (or Python keyword arguments)."""
    id: str | None = None
    """The call's id: None unless the model wrote one (llama.cpp's generic format does); the API assigns one."""


class ToolSyntax(Protocol):
    """How one family of models writes tool calls."""

    @property
    def name(self) -> str:
        """ "hermes", "llama3", "gemma" or "fallback"."""
        ...

    @property
    def opener(self) -> str:
        """The text that usually starts a call (`openers` lists every start `parse` reads)."""
        ...

    @property
    def openers(self) -> tuple[str, ...]:
        """Every literal that can start a call `parse` reads (case-insensitive); a stream holds text from
        one on (`content_prefix_len`)."""
        ...

    @property
    def parallel_calls(self) -> bool:
        """Whether the family's templates take several calls in one assistant turn (Llama 3's raise on two:
        the API should answer with one call, `parallel_tool_calls` false)."""
        ...

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) for the model's whole output; the text around calls is the content."""
        ...

    def grammar(
        self,
        tools: list[dict[str, Any]],
        choice: str | dict[str, Any],
        parallel: bool,
        *,
        special: Collection[str] = (),
    ) -> str:
        """An llguidance Lark grammar for calls to `tools` under `choice` ("required" or a named function);
        `special`: texts that are special tokens in the model's vocabulary (e.g. Qwen's ``<tool_call>``),
        written as token references. ValueError for a choice that forces nothing or names no tool."""
        ...


# --- the tools list ---------------------------------------------------------------------------


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """`tools` in Hugging Face's shape (``{"type": "function", "function": {"name", "description",
    "parameters"}}``); a bare function object is wrapped. Raises TemplateError naming the bad entry."""
    if not isinstance(tools, list):
        raise TemplateError(f"tools must be a list, not {type(tools).__name__}")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise TemplateError(f"tools[{i}] must be an object, not {type(tool).__name__}")
        kind = tool.get("type", "function")
        if kind != "function":
            raise TemplateError(f"tools[{i}].type must be 'function', got {kind!r}")
        fn = tool["function"] if "function" in tool else tool
        where = f"tools[{i}].function" if "function" in tool else f"tools[{i}]"
        if not isinstance(fn, dict):
            raise TemplateError(f"{where} must be an object, not {type(fn).__name__}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise TemplateError(f"{where}.name must be a non-empty string, got {name!r}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise TemplateError(f"{where}.parameters must be a JSON schema object, not {type(params).__name__}")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise TemplateError(f"{where}.description must be a string, not {type(desc).__name__}")
        body = {k: v for k, v in fn.items() if k not in ("type", "function")}
        out.append({"type": "function", "function": body})
    return out


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) else {}


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = _function(tool).get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def tool_choice_name(choice: str | dict[str, Any]) -> str | None:
    """The function a `tool_choice` names (``{"type": "function", "function": {"name": ...}}`` or a bare
    name), or None for "required"; ValueError for "auto"/"none" (nothing to force) or a malformed choice."""
    if isinstance(choice, str):
        if choice == "required":
            return None
        if choice in ("auto", "none") or not choice:
            raise ValueError(f"tool_choice {choice!r} does not force a call")
        return choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
        if isinstance(name, str) and name:
            return name
    raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or name a function, got {choice!r}")


def _chosen(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    name = tool_choice_name(choice)
    if not tools:
        raise ValueError("tool_choice forces a call but no tools were given")
    if name is None:
        return tools
    picked = [t for t in tools if _function(t).get("name") == name]
    if not picked:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return picked[:1]


# --- the fallback prompt ----------------------------------------------------------------------

_FALLBACK_HEAD = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>"
)
_FALLBACK_TAIL = (
    "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def fallback_tools_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """The system-prompt block that teaches a template without tool support the Hermes syntax: the tools
    as one JSON object a line inside ``<tools>``, then how to answer with ``<tool_call>`` (Qwen2.5's wording)."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return _FALLBACK_HEAD + lines + _FALLBACK_TAIL


def hermes_call_text(name: str, arguments: Any) -> str:
    """One call written the Hermes way (how the fallback renders an assistant's earlier calls)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


# --- parsing ----------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = " \t\r\n"
_MAX_PY = 100_000
"""Longest Python-style call text handed to `ast` (a model's output is bounded anyway)."""
_WRAPPER_TAGS = ("tool_call", "function_call", "tools", "tool", "response", "json", "xml")
_TAG = re.compile(r"<(" + "|".join(_WRAPPER_TAGS) + r")>", re.IGNORECASE)
_FUNCTION_TAG = re.compile(r"""<function(?:=([^>\s]+)|\s+name\s*=\s*"([^"]+)"\s*)>""", re.IGNORECASE)
_FENCE = re.compile(r"```([A-Za-z_]*)[ \t]*\r?\n?")
_PYTHON_TAG = "<|python_tag|>"


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
    return None if end is None else ([ToolCall(name=m.group(1) or m.group(2), arguments=got[0])], end)


class _Parser:
    """The scanner every syntax shares; the flags say which forms it reads."""

    def __init__(
        self,
        *,
        tags: bool,
        fences: frozenset[str],
        python_fences: frozenset[str],
        python_tag: bool,
        bare_json: bool,
        bare_python: bool,
        separators: str,
    ) -> None:
        self.tags = tags
        self.fences = fences
        self.python_fences = python_fences
        self.python_tag = python_tag
        self.bare_json = bare_json
        self.bare_python = bare_python
        self.separators = separators

    # A block at `i`: (calls, end) or None.
    def block(self, text: str, i: int) -> _Match | None:
        c = text[i]
        if c == "<":
            if self.python_tag and text.startswith(_PYTHON_TAG, i):
                return self.python_tag_block(text, i + len(_PYTHON_TAG))
            if self.tags:
                return _tag_block(text, i) or _function_block(text, i)
            return None
        if c == "`":
            return self.fence_block(text, i)
        if c in "{[" and _line_start(text, i):
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
            calls.extend(got[0])
            pos = i = got[1]
            after_call = True
        if not after_call:
            return text, []
        rest = text[pos:].lstrip(_WS)
        pieces.append(rest)
        return "\n".join(p for p in pieces if p), calls


def _line_start(text: str, i: int) -> bool:
    """Whether only spaces stand between `i` and the start of its line."""
    j = i
    while j > 0 and text[j - 1] in " \t":
        j -= 1
    return j == 0 or text[j - 1] == "\n"


# --- the syntaxes -----------------------------------------------------------------------------


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _lark_text(text: str, special: Collection[str]) -> str:
    """`text` as a Lark sequence: string literals, with each special token of the model's vocabulary in it
    (``<tool_call>`` in Qwen's) written as a token reference, since a string literal cannot match one."""
    names = sorted((t for t in special if t in text and _TOKEN_REF.fullmatch(t)), key=len, reverse=True)
    pieces = re.split("(" + "|".join(map(re.escape, names)) + ")", text) if names else [text]
    return " ".join(p if p in names else _lark_literal(p) for p in pieces if p)


_TOKEN_REF = re.compile(r"<[^<>\s\[\]]+>")
"""What llguidance's ``<name>`` token-reference syntax can name."""

Writer = Callable[[list[dict[str, Any]], "str | dict[str, Any]", bool, Collection[str]], str]


def _grammar(
    tools: list[dict[str, Any]],
    choice: str | dict[str, Any],
    parallel: bool,
    special: Collection[str],
    *,
    prefix: str,
    args_key: str,
    suffix: str,
    separator: str,
) -> str:
    """``start`` = one call (or 1+ joined by `separator` when parallel); a call is `prefix`, then
    ``{"name": "<tool>", "<args_key>": `` and the tool's parameters as ``%json``, then ``}`` and `suffix`."""
    chosen = _chosen(tools, choice)
    sep = _lark_text(separator, special)
    lines = [f"start: call ({sep} call)*" if parallel else "start: call"]
    call = [_lark_text(prefix, special), "body", _lark_text("}" + suffix, special)]
    lines.append("call: " + " ".join(p for p in call if p))
    lines.append("body: " + " | ".join(f"fn_{k}" for k in range(len(chosen))))
    for k, tool in enumerate(chosen):
        head = "{" + f'"name": {json.dumps(_function(tool)["name"], ensure_ascii=False)}, "{args_key}": '
        lines.append(f"fn_{k}: {_lark_literal(head)} args_{k}")
        lines.append(f"args_{k}: %json {json.dumps(_schema(tool), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _Syntax:
    name: str
    opener: str
    openers: tuple[str, ...]
    parser: _Parser
    write: Writer
    parallel_calls: bool = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls); never raises, garbage stays content."""
        try:
            return self.parser.parse(text)
        except Exception:  # a parser bug must not turn a reply into a 500: the text is content
            return text, []

    def grammar(
        self,
        tools: list[dict[str, Any]],
        choice: str | dict[str, Any],
        parallel: bool,
        *,
        special: Collection[str] = (),
    ) -> str:
        """The Lark grammar forcing calls to `tools` under `choice` (ValueError for auto/none/unknown)."""
        return self.write(tools, choice, parallel, special)


def _hermes_grammar(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool, special: Collection[str]
) -> str:
    return _grammar(
        tools,
        choice,
        parallel,
        special,
        prefix="<tool_call>\n",
        args_key="arguments",
        suffix="\n</tool_call>",
        separator="\n",
    )


def _llama3_grammar(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool, special: Collection[str]
) -> str:
    return _grammar(tools, choice, parallel, special, prefix="", args_key="parameters", suffix="", separator="; ")


_HERMES_OPENERS = (
    "<tool_call>",
    "<function=",
    "<function ",
    "<function_call>",
    "<tools>",
    "<tool>",
    "<response>",
    "<json>",
    "<xml>",
    "```json",
    "```xml",
    "```\n",
    "{",
)
_HERMES_PARSER = _Parser(
    tags=True,
    fences=frozenset({"", "json", "xml"}),
    python_fences=frozenset(),
    python_tag=False,
    bare_json=True,
    bare_python=False,
    separators="",
)
HERMES = _Syntax("hermes", "<tool_call>", _HERMES_OPENERS, _HERMES_PARSER, _hermes_grammar)
FALLBACK = _Syntax("fallback", "<tool_call>", _HERMES_OPENERS, _HERMES_PARSER, _hermes_grammar)
LLAMA3 = _Syntax(
    "llama3",
    "{",
    (_PYTHON_TAG, "{", "```json", "```\n"),
    _Parser(
        tags=False,
        fences=frozenset({"", "json"}),
        python_fences=frozenset(),
        python_tag=True,
        bare_json=True,
        bare_python=False,
        separators=";",
    ),
    _llama3_grammar,
    parallel_calls=False,
)
GEMMA = _Syntax(
    "gemma",
    "<tool_call>",
    (*_HERMES_OPENERS, "```tool_code", "```python", "["),
    _Parser(
        tags=True,
        fences=frozenset({"", "json", "xml"}),
        python_fences=frozenset({"tool_code", "python", "py"}),
        python_tag=False,
        bare_json=True,
        bare_python=True,
        separators="",
    ),
    _hermes_grammar,
)
"""Gemma answers our fallback prompt, so its grammar writes Hermes calls; it also reads its own habits."""

SYNTAXES: dict[str, ToolSyntax] = {s.name: s for s in (HERMES, LLAMA3, GEMMA, FALLBACK)}


def tool_syntax(template: str | None, arch: str) -> ToolSyntax:
    """The syntax a model writes calls in, from markers in its template source: ``<tool_call>`` is Hermes;
    ``<|python_tag|>`` or ``ipython`` (with ``tools``) is Llama 3; a Gemma architecture whose template knows no
    tools is Gemma; anything else gets the fallback prompt and its Hermes syntax."""
    supports = template_supports_tools(template)
    if template is not None and supports:
        if "<tool_call>" in template:
            return HERMES
        if _PYTHON_TAG in template or "ipython" in template:
            return LLAMA3
    if arch.startswith("gemma") and not supports:
        return GEMMA
    return HERMES if supports else FALLBACK


@lru_cache(maxsize=16)
def template_supports_tools(template: str | None) -> bool:
    """Whether the template reads a ``tools`` variable (its AST loads the name), as HF's tool templates do;
    False for no template or one that does not parse (rendering it reports that)."""
    if template is None:
        return False
    try:
        tree = _ENV.parse(template)
    except (jinja2.TemplateError, RecursionError):
        return False
    return any(node.name == "tools" and node.ctx == "load" for node in tree.find_all(nodes.Name))


def content_prefix_len(syntax: ToolSyntax, text: str, start: int = 0) -> int:
    """How much of `text` (the output so far) is content whatever comes next: everything before the first
    place a call could start (an opener — ``{``/``[`` only at a line start — or the start of one cut off at
    the end), less the whitespace before it. A stream sends that much as content and holds the rest until
    `parse` reads the whole output; parse's content then starts with what was sent. `start`: what was sent
    already (no opener starts before it), so a stream scans each piece once."""
    literal, bare = _opener_patterns(syntax.openers)
    cut = len(text)
    m = literal.search(text, start) if literal is not None else None
    if m is not None:
        cut = m.start()
    for ch in bare:
        k = _first_at_line_start(text, ch, start, cut)
        if k is not None:
            cut = k
    for op in syntax.openers:  # an opener cut off at the end: hold its start
        for n in range(min(len(op) - 1, len(text) - start), 0, -1):
            if text[len(text) - n :].lower() == op[:n].lower():
                cut = min(cut, len(text) - n)
                break
    return max(start, len(text[:cut].rstrip(_WS)))


@lru_cache(maxsize=8)
def _opener_patterns(openers: tuple[str, ...]) -> tuple[re.Pattern[str] | None, tuple[str, ...]]:
    """One case-insensitive pattern for the literal openers, and the bare ones (``{``, ``[``: line starts only)."""
    bare = tuple(o for o in openers if o in ("{", "["))
    literal = sorted((o for o in openers if o not in bare), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, literal)), re.IGNORECASE) if literal else None
    return pattern, bare


def _first_at_line_start(text: str, ch: str, start: int, end: int) -> int | None:
    k = text.find(ch, start, end)
    while k >= 0:
        if _line_start(text, k):
            return k
        k = text.find(ch, k + 1, end)
    return None
