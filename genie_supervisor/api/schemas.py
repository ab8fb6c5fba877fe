"""Request bodies of the generation routes (OpenAI and llama-server shapes), validated strictly.

Unknown fields are ignored (clients send many we do not use); a known field of the wrong type or
out of its range (NaN and infinities included) is a 400 in OpenAI's error shape naming the field
(``param``). ``parse_body`` turns raw bytes into one of these models or raises ``BadRequest``.
Token ids are checked against the vocabulary once the model is known (`check_token_ids`). The fields
beyond sampling (tools, response_format, grammars, logit_bias) are checked by `request_extras`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from engine import SamplingParams
from engine.generate import TokenIdError, check_prompt_ids

from ..errors import BadRequest
from ..jsonlimits import MAX_DEPTH, loads_bounded
from ..llm.serving import NO_EXTRAS, RequestExtras
from .request_extras import (
    check_logit_bias,
    check_tool_choice,
    check_tools,
    decode_tool_calls,
    grammar_field,
    plain_extras,
    response_format_grammar,
)

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
    # defer_build: a request model's validator is built by its first request (about 1-2 ms), not by
    # the daemon's start, which imports every route module before the first token can be served.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, defer_build=True)


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
                d["tool_calls"] = decode_tool_calls(i, m.tool_calls)
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
