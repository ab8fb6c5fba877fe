"""Request bodies of the generation routes (OpenAI and llama-server shapes), validated strictly.

Unknown fields are ignored (clients send many we do not use); a known field of the wrong type or
out of its range (NaN and infinities included) is a 400 in OpenAI's error shape naming the field
(``param``). ``parse_body`` turns raw bytes into one of these models or raises ``BadRequest``.
Token ids are checked against the vocabulary once the model is known (`check_token_ids`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from engine import Grammar, GrammarError, SamplingParams
from engine.generate import TokenIdError, check_prompt_ids

from ..errors import BadRequest
from ..jsonlimits import MAX_DEPTH, loads_bounded
from ..llm.serving import NO_EXTRAS, RequestExtras

T = TypeVar("T", bound=BaseModel)

_TYPE_WORDS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "tagged-union"}

SEED_MAX = 2**64 - 1
"""Largest seed (the samplers' generators take 64 bits)."""
MAX_STOPS = 16
"""Most stop strings a request may give."""
MAX_STOP_CHARS = 1024
"""Longest stop string."""
NAME_CHARS = 256
"""Longest model id / priority name (they are echoed in errors)."""
GREEDY_BELOW = 1e-30
"""Temperatures under this are 0 (greedy): sampling is greedy there anyway, and logits / T overflows."""


def _temperature(t: float) -> float:
    return 0.0 if t < GREEDY_BELOW else t


def _one_kind(items: Any, allowed: str) -> Any:
    """A list prompt holds one kind of item (a clearer 400 than each union member's complaint)."""
    if isinstance(items, list) and items:
        kinds = {
            "int"
            if type(x) is int
            else "str"
            if isinstance(x, str)
            else "list"
            if isinstance(x, list)
            else type(x).__name__
            for x in items
        }
        if len(kinds) > 1 or not kinds <= set(allowed.split()):
            raise PydanticCustomError(
                "prompt_items",
                "a list prompt holds {allowed}, all of one kind; got {got}",
                {
                    "allowed": " or ".join(_KIND_WORDS[k] for k in allowed.split()),
                    "got": " and ".join(sorted(_KIND_WORDS.get(k, k) for k in kinds)),
                },
            )
    return items


_KIND_WORDS = {
    "int": "token ids (integers)",
    "str": "strings",
    "list": "lists of token ids",
    "bool": "booleans",
    "float": "numbers",
    "dict": "objects",
    "NoneType": "nulls",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class ContentPart(_Body):
    """One part of a message's content (only ``text`` parts are supported)."""

    type: str = Field(..., description="part type; only text")
    text: str | None = Field(None, description="the text")


class Message(_Body):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(..., description="who speaks")
    content: str | list[ContentPart] | None = Field(None, description="text, or a list of text parts")
    name: str | None = Field(None, description="speaker name (passed to the template)")
    tool_calls: list[Any] | None = Field(
        None, description="an assistant's calls: {id, type: function, function: {name, arguments: JSON text}}"
    )
    tool_call_id: str | None = Field(None, max_length=NAME_CHARS, description="a tool result: the call it answers")

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequest(
                    f"message content part of type {part.type!r} is not supported (only text)", "messages.content"
                )
            out.append(part.text)
        return "".join(out)


MAX_TOOLS = 128
"""Most tools a request may give (OpenAI's limit)."""
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""What a function's name may be (OpenAI's rule)."""
BIAS_LIMIT = 100.0
"""logit_bias values are within +-100 (OpenAI's range); -100 (or llama-server's false) bans the token."""
MAX_BIASES = 1024
"""Most logit_bias entries a request may give."""


def _tool_calls(i: int, calls: list[Any]) -> list[dict[str, Any]]:
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


class StreamOptions(_Body):
    """Options of a streamed answer."""

    include_usage: bool = Field(False, description="send a last chunk with usage")


class _Sampling(_Body):
    model: str | None = Field(
        None, max_length=NAME_CHARS, description="model id or role (default: the first resident model)"
    )
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy (so is anything below 1e-30)")
    top_p: float | None = Field(None, ge=0, le=1, description="nucleus sampling")
    top_k: int | None = Field(None, ge=0, le=100_000, description="keep the k most likely tokens (0 = all)")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens below min_p x the best one")
    seed: int | None = Field(None, ge=-1, le=SEED_MAX, description="random seed (-1: random)")
    stop: str | list[str] | None = Field(None, description="stop strings (not included in the output)")
    stream: bool = Field(False, description="stream the answer as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="streaming options")
    n: int | None = Field(None, ge=1, le=128, description="choices to generate: only 1")
    priority: str | None = Field(
        None, max_length=NAME_CHARS, description="request class (voice, tool, background); or header X-Genie-Priority"
    )
    logit_bias: dict[str, Any] | list[Any] | None = Field(
        None, description='{"<token id>": bias} (-100..100; -100 bans), or llama-server\'s [[id or text, bias|false]]'
    )
    json_schema: dict[str, Any] | None = Field(None, description="llama-server: the output is an instance of it")
    grammar: str | None = Field(
        None, max_length=1_000_000, description="llama-server: a GBNF grammar the output follows"
    )

    def check_n(self) -> None:
        if self.n is not None and self.n != 1:
            raise BadRequest(f"n must be 1 (got {self.n}): one choice per request", "n")

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return check_stops((self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters (defaults: llama-server's)."""
        top_p = self.top_p if self.top_p is not None else 0.95
        top_k = self.top_k if self.top_k is not None else 40
        if top_p == 0:
            top_p, top_k = 1.0, 1
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_temperature(self.temperature if self.temperature is not None else 0.8),
            top_k=top_k,
            top_p=top_p,
            min_p=self.min_p if self.min_p is not None else 0.05,
            seed=None if self.seed is None or self.seed < 0 else self.seed,
            stop=self.stops(),
            logit_bias=check_logit_bias(self.logit_bias)[0],
            logprobs=self.top_n(),
        )

    def top_n(self) -> int | None:
        """Alternatives per token's log-probabilities (None: none asked)."""
        return None

    def extras(self) -> RequestExtras:
        """Constrained output and biases by string (no tools: chat adds them)."""
        return plain_extras(self.json_schema, self.grammar, self.logit_bias)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(..., min_length=1, description="the conversation")
    max_tokens: int | None = Field(None, ge=1, le=1_048_576, description="most tokens to generate")
    max_completion_tokens: int | None = Field(None, ge=1, le=1_048_576, description="same as max_tokens (wins)")
    tools: list[Any] | None = Field(None, description="function tools: {type: function, function: {name, ...}}")
    tool_choice: str | dict[str, Any] | None = Field(None, description="none, auto (default), required, or a function")
    parallel_tool_calls: bool | None = Field(
        None, description="whether an answer may call several tools (default true)"
    )
    response_format: dict[str, Any] | None = Field(None, description="text, json_object, or json_schema")
    logprobs: bool | None = Field(None, description="each token's log-probability in the answer")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="the most likely alternatives per token")

    def prompt(self) -> list[dict[str, Any]]:
        """Messages as the engine's chat template takes them: tool calls' arguments decoded (400 naming
        ``messages[i].tool_calls[j].function.arguments`` when not JSON), a tool result named by its call."""
        out = []
        names: dict[str, str] = {}
        for i, m in enumerate(self.messages):
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name:
                d["name"] = m.name
            if m.tool_calls:
                if m.role != "assistant":
                    raise BadRequest(
                        f"messages[{i}].tool_calls: only an assistant message has tool calls",
                        f"messages[{i}].tool_calls",
                    )
                d["tool_calls"] = _tool_calls(i, m.tool_calls)
                names.update({c["id"]: c["function"]["name"] for c in d["tool_calls"] if "id" in c})
            if m.role == "tool" and m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
                if "name" not in d and m.tool_call_id in names:
                    d["name"] = names[m.tool_call_id]
            out.append(d)
        return out

    def top_n(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def extras(self) -> RequestExtras:
        """Tools, tool_choice and constrained output (response_format, or llama-server's fields)."""
        grammar, param = grammar_field(self.json_schema, self.grammar)
        if self.response_format is not None:
            fmt, fmt_param = response_format_grammar(self.response_format)
            if fmt is not None and grammar is not None:
                raise BadRequest(f"response_format and {param} cannot both be given", "response_format")
            if fmt is not None:
                grammar, param = fmt, fmt_param
        tools = check_tools(self.tools) if self.tools else ()
        choice = check_tool_choice(self.tool_choice, tools)
        if tools and choice != "none" and grammar is not None:
            raise BadRequest(f"{param} cannot be combined with tools (unless tool_choice is 'none')", param)
        texts = check_logit_bias(self.logit_bias)[1]
        if not tools and grammar is None and not texts:
            return NO_EXTRAS
        return RequestExtras(
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls is not False,
            grammar=grammar,
            grammar_param=param,
            bias_text=texts,
        )


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, one text in a list, token ids, or one list of token ids in a list"
    )
    max_tokens: int | None = Field(None, ge=1, le=1_048_576, description="most tokens to generate (default 16)")
    logprobs: int | None = Field(None, ge=0, le=20, description="log-probabilities of each token and n alternatives")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_items(cls, v: Any) -> Any:
        return _one_kind(v, "int str list")

    def top_n(self) -> int | None:
        return self.logprobs

    def text_prompt(self) -> tuple[str | list[int], str]:
        """The one prompt (text or token ids) and the name its token ids are reported under."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise BadRequest(f"one prompt per request (a list of exactly one prompt, got {len(p)})", "prompt")
            p, name = p[0], "prompt[0]"
        else:
            name = "prompt"
        if not p:
            raise BadRequest("the prompt is empty", name)
        return p, name  # type: ignore[return-value]


class LlamaCompletionRequest(_Body):
    """``POST /completion`` (llama-server's native shape)."""

    prompt: str | list[int] = Field(..., description="text or token ids (not both mixed)")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_items(cls, v: Any) -> Any:
        return _one_kind(v, "int")

    n_predict: int = Field(-1, ge=-1, le=1_048_576, description="most tokens to generate (-1: api.default_max_tokens)")
    temperature: float = Field(0.8, ge=0, le=2, description="0 = greedy (so is anything below 1e-30)")
    top_k: int = Field(40, ge=0, le=100_000)
    top_p: float = Field(0.95, ge=0, le=1)
    min_p: float = Field(0.05, ge=0, le=1)
    seed: int = Field(-1, ge=-1, le=SEED_MAX, description="-1: random")
    stop: list[str] = Field(default_factory=list, description=f"stop strings (at most {MAX_STOPS})")
    stream: bool = False
    repeat_penalty: float = Field(1.0, ge=1e-6, le=10, description="1 = off; logits / it must not overflow")
    repeat_last_n: int = Field(64, ge=0, le=1_048_576)
    ignore_eos: bool = False
    model: str | None = Field(None, max_length=NAME_CHARS, description="model id or role (an extension)")
    priority: str | None = Field(None, max_length=NAME_CHARS, description="request class (an extension)")
    n_probs: int = Field(0, ge=0, le=20, description="each token's log-probability and the n most likely ones")
    logit_bias: dict[str, Any] | list[Any] | None = Field(
        None, description="[[token id or text, bias or false], ...] or {id or text: bias}; -100 or false bans"
    )
    json_schema: dict[str, Any] | None = Field(None, description="the output is an instance of this JSON schema")
    grammar: str | None = Field(None, max_length=1_000_000, description="a GBNF grammar the output follows")

    def sampling(self, default_max: int) -> SamplingParams:
        top_p, top_k = self.top_p, self.top_k
        if top_p == 0:
            top_p, top_k = 1.0, 1
        return SamplingParams(
            max_tokens=default_max if self.n_predict < 0 else self.n_predict,
            temperature=_temperature(self.temperature),
            top_k=top_k,
            top_p=top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            repeat_last_n=self.repeat_last_n,
            seed=None if self.seed < 0 else self.seed,
            stop=check_stops(tuple(self.stop)),
            ignore_eos=self.ignore_eos,
            logit_bias=check_logit_bias(self.logit_bias)[0],
            logprobs=self.n_probs or None,
        )

    def extras(self) -> RequestExtras:
        """``json_schema`` / ``grammar`` and biases by string."""
        return plain_extras(self.json_schema, self.grammar, self.logit_bias)


def check_stops(stops: tuple[str, ...]) -> tuple[str, ...]:
    """The non-empty stop strings; BadRequest when there are too many or one is too long."""
    if len(stops) > MAX_STOPS:
        raise BadRequest(f"at most {MAX_STOPS} stop strings (got {len(stops)})", "stop")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise BadRequest(
                f"stop[{i}]: a stop string has at most {MAX_STOP_CHARS} characters (got {len(s)})", f"stop[{i}]"
            )
    return tuple(s for s in stops if s)


def check_token_ids(ids: list[int], n_vocab: int | None, name: str = "prompt") -> None:
    """BadRequest naming the first id outside 0..n_vocab-1 (only negatives when n_vocab is unknown)."""
    try:
        check_prompt_ids(ids, n_vocab, name)
    except TokenIdError as exc:
        raise BadRequest(str(exc), exc.param) from None


def _param(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and (p.split("[")[0] in _TYPE_WORDS or "[" in p or "-" in p):
            continue  # a union member's label, not a field
        parts.append(str(p))
    return ".".join(parts)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _surrogate(data: Any, where: str = "") -> str | None:
    """The dotted path of the first string holding a lone UTF-16 surrogate (depth is bounded)."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            return where or "(body)"
        return None
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = _surrogate(key, where) if isinstance(key, str) else None
        found = found or _surrogate(value, f"{where}.{key}" if where else str(key))
        if found:
            return found
    return None


def parse_body(raw: bytes, model: type[T]) -> T:
    """Bytes -> a request model; BadRequest (malformed or too deep JSON, not an object, wrong types)."""
    try:
        data = loads_bounded(raw, MAX_DEPTH)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}")
    where = _surrogate(data) if _SURROGATE_ESCAPE.search(raw) else None  # UTF-8 itself cannot hold one
    if where is not None:
        raise BadRequest(f"{where}: a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), not Unicode text", where)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(tuple(first.get("loc", ())))
        got = first.get("input")
        shown = json.dumps(got)[:60] if isinstance(got, (str, int, float, bool)) or got is None else type(got).__name__
        more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
        said = "" if first.get("type") == "prompt_items" else f", got {shown}"  # the message says what it got
        raise BadRequest(f"{param}: {first.get('msg', 'invalid')}{said}{more}", param or None) from None
