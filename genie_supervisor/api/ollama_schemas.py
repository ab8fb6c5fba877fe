"""Request bodies of the Ollama routes, validated strictly, and what they become for the engine.

Unknown fields and unknown ``options`` are ignored (Ollama logs and ignores them too); a known field
of the wrong type or out of range is a 400 ``{"error": "..."}`` naming it. ``options`` become
`SamplingParams` with Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, min_p 0,
repeat_penalty 1.1 over 64 tokens); ``format`` becomes a grammar; ``keep_alive`` seconds.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine import SamplingParams
from engine.errors import TemplateError
from engine.tool_calls import tool_choice_name, validate_tools

from ..errors import BadRequest
from ..llm.serving import RequestExtras
from .schemas import GREEDY_BELOW, NAME_CHARS, SEED_MAX, check_stops

_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, defer_build=True)  # as api.schemas


class Options(_Body):
    """``options``: the sampling and stop rules honoured (others are accepted and ignored)."""

    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy (default 0.8)")
    top_k: int | None = Field(None, ge=0, le=100_000, description="keep the k most likely tokens (0 = all; default 40)")
    top_p: float | None = Field(None, ge=0, le=1, description="nucleus sampling (default 0.9)")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens below min_p x the best one (default 0)")
    seed: int | None = Field(None, ge=-(2**63), le=SEED_MAX, description="random seed (negative: random)")
    num_predict: int | None = Field(
        None, ge=-2, le=1_048_576, description="most tokens to generate (-1, -2: api.default_max_tokens)"
    )
    stop: str | list[str] | None = Field(None, description="stop strings (not included in the output)")
    repeat_penalty: float | None = Field(None, ge=1e-6, le=10, description="1 = off (default 1.1)")
    repeat_last_n: int | None = Field(None, ge=-1, le=1_048_576, description="penalty window (-1: num_ctx; 0: off)")
    num_ctx: int | None = Field(None, ge=1, le=1_048_576, description="read, never above the model's n_ctx")


class ToolFunctionCall(_Body):
    """An earlier call's function."""

    name: str = Field(..., min_length=1, description="the function's name")
    arguments: dict[str, Any] | str = Field(default_factory=dict, description="its arguments (an object)")


class ToolCallIn(_Body):
    """One call an earlier assistant message made."""

    function: ToolFunctionCall


class ChatMessage(_Body):
    """One message of ``/api/chat``."""

    role: Literal["system", "user", "assistant", "tool"] = Field(..., description="who speaks")
    content: str | None = Field(None, description="the text")
    images: list[str] | None = Field(None, description="base64 images: refused (the models read text only)")
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant's calls")
    tool_name: str | None = Field(None, description="the tool a tool message answers for")
    thinking: str | None = Field(None, description="an assistant's reasoning (not passed to the template)")


class GenerationBody(_Body):
    model: str = Field(..., min_length=1, max_length=NAME_CHARS, description="an Ollama name (id or role)")
    format: str | dict[str, Any] | None = Field(None, description='"json" or a JSON schema')
    options: Options | None = Field(None, description="sampling options")
    stream: bool = Field(True, description="NDJSON lines (Ollama's default) or one object")
    keep_alive: str | float | None = Field(None, description='"5m", seconds, negative: forever, 0: unload after')
    think: bool | str | None = Field(None, description="reasoning output: not offered (true is refused)")
    priority: str | None = Field(
        None, max_length=NAME_CHARS, description="request class (an extension); or header X-Genie-Priority"
    )
    logprobs: bool = Field(False, description="each line carries its tokens' log-probabilities")
    top_logprobs: int = Field(0, ge=0, le=20, description="and the most likely alternatives of each (0..20)")

    def sampling(self, default_max: int) -> SamplingParams:
        """The engine's sampling parameters (Ollama's defaults where `options` says nothing)."""
        o = self.options or Options()
        top_p = o.top_p if o.top_p is not None else 0.9
        top_k = o.top_k if o.top_k is not None else 40
        if top_p == 0:
            top_p, top_k = 1.0, 1
        temperature = o.temperature if o.temperature is not None else 0.8
        repeat_last_n = o.repeat_last_n if o.repeat_last_n is not None else 64
        penalty = o.repeat_penalty if o.repeat_penalty is not None else 1.1
        if repeat_last_n == 0:
            penalty = 1.0
        elif repeat_last_n < 0:
            repeat_last_n = 1_048_576  # Ollama: the whole context
        stop = () if o.stop is None else (o.stop,) if isinstance(o.stop, str) else tuple(o.stop)
        n = o.num_predict
        return SamplingParams(
            max_tokens=default_max if n is None or n < 0 else n,
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=o.min_p if o.min_p is not None else 0.0,
            repeat_penalty=penalty,
            repeat_last_n=repeat_last_n,
            seed=None if o.seed is None or o.seed < 0 else o.seed,
            stop=check_stops(stop),
            logprobs=self.top_logprobs if self.logprobs else None,
        )

    def grammar(self) -> Any:
        """The grammar ``format`` asks for (None: free text); BadRequest naming ``format``."""
        f = self.format
        if f is None or f == "":
            return None
        from engine.constrain import Grammar
        from engine.errors import GrammarError

        try:
            if f == "json":
                return Grammar.json_object()
            if isinstance(f, dict):
                return Grammar.json_schema(f, strict=False)
        except GrammarError as exc:
            raise BadRequest(f"format: {exc}", "format") from None
        raise BadRequest(f'format must be "json" or a JSON schema object, got {f!r}', "format")

    def keep_alive_s(self) -> float | None:
        """``keep_alive`` in seconds (negative: forever; None: not given); BadRequest naming it."""
        return keep_alive_seconds(self.keep_alive)

    def check_think(self, model: str) -> None:
        """Thinking output is not offered: ``think: true`` (or a level) is refused as Ollama refuses it."""
        if self.think not in (None, False, "", "none", "false"):
            raise BadRequest(f'"{model}" does not support thinking', "think")

    def check_offered(self) -> None:
        """BadRequest for what this daemon does not offer (thinking; a route's own fields), naming the field."""
        self.check_think(self.model)

    def load_only(self) -> bool:
        """Nothing to generate: the request loads (or with ``keep_alive: 0`` unloads) the model."""
        raise NotImplementedError


class ChatBody(GenerationBody):
    """``POST /api/chat``."""

    messages: list[ChatMessage] = Field(default_factory=list, description="the conversation ([]: load or unload)")
    tools: list[dict[str, Any]] | None = Field(None, description="function tools")
    tool_choice: str | dict[str, Any] = Field(
        "auto", description="an extension (OpenAI's): auto, none, required or a function's name; Ollama has none"
    )
    parallel_tool_calls: bool = Field(True, description="an extension (OpenAI's): several calls may come back")

    def load_only(self) -> bool:
        return not self.messages

    def extras(self) -> RequestExtras:
        """Tools (checked), the tool choice and ``format``'s grammar; BadRequest naming the field."""
        try:
            tools = validate_tools(self.tools) if self.tools else []
        except TemplateError as exc:
            raise BadRequest(str(exc), "tools") from None
        choice = self.tool_choice
        if choice not in ("auto", "none"):
            try:
                name = tool_choice_name(choice)
            except ValueError as exc:
                raise BadRequest(f"tool_choice: {exc}", "tool_choice") from None
            names = [t["function"].get("name") for t in tools]
            if not tools or (name is not None and name not in names):
                wanted = "a call" if name is None else f"a call of {name!r}"
                raise BadRequest(f"tool_choice forces {wanted}, which is not among the tools", "tool_choice")
        return RequestExtras(
            tools=tuple(tools),
            tool_choice=choice,
            parallel_tool_calls=self.parallel_tool_calls,
            grammar=self.grammar(),
            grammar_param="format",
        )

    def prompt(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them (a tool message's ``tool_name`` as its ``name``)."""
        out = []
        for i, m in enumerate(self.messages):
            if m.images:
                raise BadRequest(f"messages[{i}].images: the models here read text only", f"messages[{i}].images")
            d: dict[str, Any] = {"role": m.role, "content": m.content or ""}
            if m.tool_calls:
                d["tool_calls"] = [{"function": c.function.model_dump()} for c in m.tool_calls]
            if m.tool_name:
                d["name"] = m.tool_name
            out.append(d)
        return out


class GenerateBody(GenerationBody):
    """``POST /api/generate``."""

    prompt: str = Field("", description="the prompt ('' : load or unload)")
    system: str | None = Field(None, description="system message (templated prompts)")
    raw: bool = Field(False, description="the prompt as it is, no chat template")
    suffix: str | None = Field(None, description="fill-in-the-middle: refused")
    template: str | None = Field(None, description="a Go template: refused (the model's own template is used)")
    context: list[int] | None = Field(None, description="tokens of an earlier answer: refused (use /api/chat)")
    images: list[str] | None = Field(None, description="refused (the models read text only)")

    def load_only(self) -> bool:
        return not self.prompt

    def check_offered(self) -> None:
        """BadRequest for the fields this daemon does not offer (each names itself)."""
        super().check_offered()
        if self.suffix:
            raise BadRequest("suffix: fill-in-the-middle is not offered by this daemon", "suffix")
        if self.template:
            raise BadRequest("template: only the model's own chat template is used", "template")
        if self.context:
            raise BadRequest("context: earlier answers' tokens are not taken; send the history to /api/chat", "context")
        if self.images:
            raise BadRequest("images: the models here read text only", "images")

    def text_or_messages(self) -> str | list[dict[str, Any]]:
        """The prompt as it is (``raw``), else a conversation for the chat template (system, user)."""
        if self.raw:
            return self.prompt
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return [*messages, {"role": "user", "content": self.prompt}]


class NameBody(_Body):
    """``POST /api/show`` and ``/api/pull`` (``name`` is the old spelling of ``model``)."""

    model: str | None = Field(None, max_length=NAME_CHARS, description="an Ollama name")
    name: str | None = Field(None, max_length=NAME_CHARS, description="the same (older clients)")
    stream: bool = Field(True, description="pull: NDJSON status lines (default) or one object")
    verbose: bool = Field(False, description="show: ignored (large arrays are never sent)")

    def which(self) -> str:
        """The name asked for; BadRequest when there is none."""
        name = self.model or self.name
        if not name:
            raise BadRequest("model is required", "model")
        return name


def keep_alive_seconds(value: str | float | None) -> float | None:
    """Ollama's ``keep_alive`` (a Go duration such as ``"5m"``/``"1h30m"``, or seconds) in seconds."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    total, pos = 0.0, 0
    for m in _DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not body or pos != len(body) or not math.isfinite(total):
        raise BadRequest(f'keep_alive: expected a duration such as "5m" or a number of seconds, got {value!r}')
    return sign * total
