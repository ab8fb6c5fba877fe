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

`ToolSyntax.parse` (the scanner is `engine.tool_parse`) never raises: text that is not a well-formed call (bad
JSON, positional Python arguments) stays content; Python-style calls are never evaluated. A stream sends
the first `content_prefix_len` characters of the output as content and holds the rest (a call may be starting)
until `parse` reads the whole output. `ToolSyntax.grammar` writes the syntax the prompt taught (Gemma's is
Hermes, since the fallback prompt teaches that); the API checks it with `engine.constrain`.
"""

from __future__ import annotations

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
from .tool_parse import PYTHON_TAG, Parser, ToolCall, line_start

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


Tools = list[dict[str, Any]]
"""A tools list in Hugging Face's shape (what `validate_tools` returns)."""
ToolChoice = str | dict[str, Any]
"""OpenAI's ``tool_choice``: "auto", "none", "required" or ``{"type": "function", "function": {"name": ...}}``."""


class ToolSyntax(Protocol):
    """How one family of models writes tool calls."""

    @property
    def name(self) -> str:
        """The syntax's name: "hermes", "llama3", "gemma" or "fallback"."""
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

    def grammar(self, tools: Tools, choice: ToolChoice, parallel: bool, *, special: Collection[str] = ()) -> str:
        """An llguidance Lark grammar for calls to `tools` under `choice` ("required" or a named function);
        `special`: texts that are special tokens in the model's vocabulary (e.g. Qwen's ``<tool_call>``),
        written as token references. ValueError for a choice that forces nothing or names no tool."""
        ...


# --- the tools list ---------------------------------------------------------------------------


def validate_tools(tools: Any) -> Tools:
    """`tools` in Hugging Face's shape (``{"type": "function", "function": {"name", "description",
    "parameters"}}``); a bare function object is wrapped. Raises TemplateError naming the bad entry."""
    if not isinstance(tools, list):
        raise TemplateError(f"tools must be a list, not {type(tools).__name__}")
    out: Tools = []
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


def tool_choice_name(choice: ToolChoice) -> str | None:
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


def _chosen(tools: Tools, choice: ToolChoice) -> Tools:
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

Writer = Callable[[Tools, ToolChoice, bool, Collection[str]], str]


def _grammar(
    tools: Tools,
    choice: ToolChoice,
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
    parser: Parser
    write: Writer
    parallel_calls: bool = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls); never raises, garbage stays content."""
        try:
            return self.parser.parse(text)
        except Exception:  # a parser bug must not turn a reply into a 500: the text is content
            return text, []

    def grammar(self, tools: Tools, choice: ToolChoice, parallel: bool, *, special: Collection[str] = ()) -> str:
        """The Lark grammar forcing calls to `tools` under `choice` (ValueError for auto/none/unknown)."""
        return self.write(tools, choice, parallel, special)


def _hermes_grammar(tools: Tools, choice: ToolChoice, parallel: bool, special: Collection[str]) -> str:
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


def _llama3_grammar(tools: Tools, choice: ToolChoice, parallel: bool, special: Collection[str]) -> str:
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
_HERMES_PARSER = Parser(
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
    (PYTHON_TAG, "{", "```json", "```\n"),
    Parser(
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
    Parser(
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
        if PYTHON_TAG in template or "ipython" in template:
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
        k = _first_atline_start(text, ch, start, cut)
        if k is not None:
            cut = k
    for op in syntax.openers:  # an opener cut off at the end: hold its start
        for n in range(min(len(op) - 1, len(text) - start), 0, -1):
            if text[len(text) - n :].lower() == op[:n].lower():
                cut = min(cut, len(text) - n)
                break
    return max(start, len(text[:cut].rstrip(" \t\r\n")))


@lru_cache(maxsize=8)
def _opener_patterns(openers: tuple[str, ...]) -> tuple[re.Pattern[str] | None, tuple[str, ...]]:
    """One case-insensitive pattern for the literal openers, and the bare ones (``{``, ``[``: line starts only)."""
    bare = tuple(o for o in openers if o in ("{", "["))
    literal = sorted((o for o in openers if o not in bare), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, literal)), re.IGNORECASE) if literal else None
    return pattern, bare


def _first_atline_start(text: str, ch: str, start: int, end: int) -> int | None:
    k = text.find(ch, start, end)
    while k >= 0:
        if line_start(text, k):
            return k
        k = text.find(ch, k + 1, end)
    return None
