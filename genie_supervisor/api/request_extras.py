"""The fields of a request beyond sampling, checked: tools and tool_choice, response_format, llama-server's
``json_schema`` and ``grammar``, ``logit_bias``, an assistant's earlier tool calls. Each problem is a
``BadRequest`` naming the field (``tools[3].function.parameters``, ``response_format.json_schema.schema``);
a schema or grammar the constraint library rejects carries the library's message. Grammars are compiled once
per text (clients repeat theirs with every request), on the loop: a few milliseconds the first time.
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

from engine import Grammar, GrammarError

from ..errors import BadRequest
from ..llm.serving import NO_EXTRAS, RequestExtras

MAX_TOOLS = 128
"""Most tools a request may give (OpenAI's limit)."""
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""What a function's name may be (OpenAI's rule)."""
BIAS_LIMIT = 100.0
"""logit_bias values are within +-100 (OpenAI's range); -100 (or llama-server's false) bans the token."""
MAX_BIASES = 1024
"""Most logit_bias entries a request may give."""


def decode_tool_calls(i: int, calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool_calls with the arguments decoded for the template."""
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise BadRequest(f"{where} must be an object, got {type(call).__name__}", where)
        if call.get("type", "function") != "function":
            raise BadRequest(f"{where}.type must be 'function', got {call.get('type')!r}", f"{where}.type")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        args: Any = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as exc:
                raise BadRequest(
                    f"{where}.function.arguments is not valid JSON: {exc}", f"{where}.function.arguments"
                ) from None
        if not isinstance(args, dict):
            raise BadRequest(
                f"{where}.function.arguments must be a JSON object, got {type(args).__name__}",
                f"{where}.function.arguments",
            )
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str):
                raise BadRequest(f"{where}.id must be a string", f"{where}.id")
            entry = {"id": call["id"], **entry}
        out.append(entry)
    return out


@functools.lru_cache(maxsize=256)
def _schema_problem(schema: str) -> str | None:
    """Why the constraint library rejects a tool's parameters schema (JSON text), leniently; None: it compiles.
    Cached: a client such as Home Assistant sends the same tools with every request."""
    try:
        Grammar.json_schema(json.loads(schema), strict=False)
    except GrammarError as exc:
        return exc.message
    return None


def check_tools(tools: list[Any]) -> tuple[dict[str, Any], ...]:
    """OpenAI function tools, each checked (BadRequest naming ``tools[i]...``) and its parameters schema compiled
    (leniently: keywords the constraint library lacks are ignored there, as in `llm.extras.lenient`)."""
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"at most {MAX_TOOLS} tools (got {len(tools)})", "tools")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{where} must be an object, got {type(tool).__name__}", where)
        if tool.get("type") != "function":
            raise BadRequest(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise BadRequest(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            shown = json.dumps(name)[:80] if isinstance(name, str) else type(name).__name__
            raise BadRequest(
                f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {shown}", f"{where}.function.name"
            )
        if name in names:
            raise BadRequest(f"{where}.function.name: {name!r} is given twice", f"{where}.function.name")
        names.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise BadRequest(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters")
        param = f"{where}.function.parameters"
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise BadRequest(f"{param} must be a JSON schema of an object ({{'type': 'object', ...}})", param)
        problem = _schema_problem(json.dumps(params))
        if problem is not None:
            raise BadRequest(f"{param}: {problem}", param)
        body = {"name": name, "parameters": params}
        if desc is not None:
            body["description"] = desc
        out.append({"type": "function", "function": body})
    return tuple(out)


def check_tool_choice(choice: Any, tools: tuple[dict[str, Any], ...]) -> str | dict[str, Any]:
    """``none``, ``auto``, ``required`` or ``{"type": "function", "function": {"name"}}`` naming one of `tools`."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise BadRequest(
                f"tool_choice must be 'none', 'auto', 'required' or name a function, got {choice!r}", "tool_choice"
            )
        if choice == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs tools", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise BadRequest(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools", "tool_choice.function.name")
    return {"type": "function", "function": {"name": name}}


@functools.lru_cache(maxsize=128)
def _compiled(kind: str, source: str, strict: bool) -> Grammar:
    """A grammar made once per text (clients repeat theirs with every request): a JSON schema's JSON text,
    GBNF text, or json_object's. GrammarError is not cached."""
    if kind == "gbnf":
        return Grammar.gbnf(source)
    if kind == "json_object":
        return Grammar.json_object()
    return Grammar.json_schema(json.loads(source), strict=strict)


def _schema(schema: Any, strict: bool, param: str) -> Grammar:
    if not isinstance(schema, dict):
        raise BadRequest(f"{param} must be a JSON schema object", param)
    try:
        return _compiled("json_schema", json.dumps(schema), strict)
    except GrammarError as exc:
        raise BadRequest(f"{param}: {exc.message}", param) from None


def _gbnf(text: str) -> Grammar:
    try:
        return _compiled("gbnf", text, True)
    except GrammarError as exc:
        raise BadRequest(f"grammar: {exc.message}", "grammar") from None


def response_format_grammar(fmt: dict[str, Any]) -> tuple[Grammar | None, str]:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``json_schema: {name,
    schema, strict}``; llama-server's ``schema`` beside the type too) as a grammar and the field it came from."""
    kind = fmt.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        if isinstance(fmt.get("schema"), dict):  # llama-server's form
            return _schema(fmt["schema"], True, "response_format.schema"), "response_format.schema"
        return _compiled("json_object", "", True), "response_format"
    if kind != "json_schema":
        raise BadRequest(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format.type",
        )
    if isinstance(fmt.get("schema"), dict) and "json_schema" not in fmt:  # llama-server's form
        return _schema(fmt["schema"], True, "response_format.schema"), "response_format.schema"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest(
            "response_format.json_schema must be an object {name, schema, strict}", "response_format.json_schema"
        )
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not TOOL_NAME.fullmatch(name)):
        raise BadRequest(
            "response_format.json_schema.name must be 1 to 64 letters, digits, _ or -",
            "response_format.json_schema.name",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest("response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict")
    schema = spec.get("schema", {})
    param = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise BadRequest(f"{param} must be a JSON schema object", param)
    return _schema(schema, strict is not False, param), param


_INT_KEY = re.compile(r"\s*-?[0-9]{1,30}\s*")


def check_logit_bias(bias: Any) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[str, float], ...]]:
    """``logit_bias`` as (token id, bias) and (text, bias) pairs: OpenAI's ``{"<id>": bias}``, llama-server's
    ``[[id or text, bias or false], ...]`` and ``{"<text>": bias}``. A bias of -100 or ``false`` bans a token."""
    if bias is None:
        return (), ()
    items = list(bias.items()) if isinstance(bias, dict) else bias
    if len(items) > MAX_BIASES:
        raise BadRequest(f"logit_bias: at most {MAX_BIASES} entries (got {len(items)})", "logit_bias")
    ids: dict[int, float] = {}
    texts: dict[str, float] = {}
    for n, entry in enumerate(items):
        where = f"logit_bias[{n}]" if isinstance(bias, list) else f"logit_bias.{entry[0]}"[:80]
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise BadRequest(f"{where} must be a [token id or text, bias] pair", "logit_bias")
        key, value = entry
        if value is False:
            value = -math.inf
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise BadRequest(f"{where}: the bias must be a number or false, got {json.dumps(value)[:40]}", "logit_bias")
        elif not -BIAS_LIMIT <= value <= BIAS_LIMIT:
            raise BadRequest(f"{where}: the bias must be within -100..100, got {value}", "logit_bias")
        b = -math.inf if value <= -BIAS_LIMIT else float(value)
        if isinstance(key, str) and _INT_KEY.fullmatch(key):
            key = int(key)
        if isinstance(key, bool):
            raise BadRequest(f"{where}: a token id or a text, not a boolean", "logit_bias")
        if isinstance(key, int):
            if key < 0:
                raise BadRequest(f"{where}: token id {key} is negative", "logit_bias")
            ids[key] = b
        elif isinstance(key, str) and key:
            texts[key] = b
        else:
            raise BadRequest(f"{where}: a token id or a non-empty text, got {json.dumps(key)[:40]}", "logit_bias")
    return tuple(sorted(ids.items())), tuple(texts.items())


def grammar_field(json_schema: dict[str, Any] | None, grammar: str | None) -> tuple[Grammar | None, str | None]:
    """llama-server's ``json_schema`` or ``grammar`` (GBNF; not both) as a grammar and its field."""
    if json_schema is not None and grammar:
        raise BadRequest('either "json_schema" or "grammar" can be specified, but not both', "grammar")
    if json_schema is not None:
        return _schema(json_schema, True, "json_schema"), "json_schema"
    if grammar:
        return _gbnf(grammar), "grammar"
    return None, None


def plain_extras(json_schema: dict[str, Any] | None, grammar: str | None, logit_bias: Any) -> RequestExtras:
    """The extras of a request without tools: llama-server's grammar fields and biases by string."""
    constraint, param = grammar_field(json_schema, grammar)
    texts = check_logit_bias(logit_bias)[1]
    if constraint is None and not texts:
        return NO_EXTRAS
    return RequestExtras(grammar=constraint, grammar_param=param, bias_text=texts)
