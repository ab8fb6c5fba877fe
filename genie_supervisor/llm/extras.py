"""A request's extras (`RequestExtras`: tools, constrained output, biases by string) made concrete for one
loaded model, in a worker thread before its generation is admitted:

    prepared = prepare(model, messages, sampling, extras)      # blocking: tokenizing, compiling grammars
    model.generate(prepared.ids, prepared.sampling, constraint=prepared.constraint)
    content, calls = prepared.tool_syntax.parse(text)          # when tools reached the prompt

- tools reach the prompt through the model's chat template (`Model.encode_chat(tools=)`, which falls back to
  `engine.tool_calls.fallback_tools_prompt` for a template without tool support), unless ``tool_choice`` is
  ``none``;
- ``tool_choice`` ``required`` or a named function constrains the output to the model's own call syntax with
  each tool's parameters as its JSON schema (`ToolSyntax.grammar`); ``auto`` generates freely and parses;
- a grammar (``response_format``, ``json_schema``, ``grammar``) becomes the generation's `Constraint`;
- ``logit_bias`` strings are tokenized and every one of their tokens gets the bias.

Errors are `GrammarError` (an `EngineError`: a 400) naming the request field.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine import Constraint, Grammar, GrammarError, Model, SamplingParams
from engine.constrain import JSON_WHITESPACE
from engine.tokenizer import ATTR_CONTROL, ATTR_UNKNOWN
from engine.tool_calls import ToolSyntax

from .serving import RequestExtras

CALL_MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>")
"""Texts of call syntaxes that some vocabularies hold as one control token (written as token references)."""


@dataclass(frozen=True)
class Prepared:
    """One request ready for the model's `generate`."""

    ids: list[int]
    """The prompt's token ids (tools rendered into it)."""
    sampling: SamplingParams
    """The sampling parameters, biases by string turned into token ids."""
    constraint: Constraint | None
    """The grammar the output must follow (None: free)."""
    tool_syntax: ToolSyntax | None
    """How the model writes calls when tools reached the prompt (None: no tools)."""
    parallel: bool
    """Whether several calls may come back (the request allows them and the model's templates take them)."""


def prepare(model: Model, prompt: Any, sampling: SamplingParams, extras: RequestExtras) -> Prepared:
    """`prompt` (messages, text or token ids) with `extras` applied, for `model` (blocking: call it in a thread)."""
    tools = [dict(t) for t in extras.tools] if extras.tools_active else None
    if isinstance(prompt, str):
        ids = model.tokenizer.encode(prompt)
    elif prompt and all(isinstance(m, Mapping) for m in prompt):
        ids = model.encode_chat([dict(m) for m in prompt], tools=tools)
    elif all(isinstance(t, int) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise ValueError("a prompt is token ids, a string, or a list of chat messages")
    syntax = model.tool_syntax if tools else None
    parallel = extras.parallel_tool_calls and (syntax is None or syntax.parallel_calls)
    grammar, param = extras.grammar, extras.grammar_param
    if syntax is not None and tools and extras.forced:
        grammar, param = _tools_grammar(model, syntax, tools, extras.tool_choice, parallel), "tools"
    constraint = None
    if grammar is not None:
        try:
            constraint = model.constrainer.start(grammar)
        except GrammarError as exc:
            exc.param = param
            raise
    return Prepared(
        ids,
        _with_text_bias(model, sampling, extras.bias_text),
        constraint,
        syntax,
        parallel,
    )


def lenient(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters as a `%json` schema inside a Lark grammar: keywords llguidance does not implement
    ignored (as a tool list from Home Assistant may hold some), JSON whitespace bounded (a schema's own
    ``x-guidance`` wins), and no top-level keys beyond the declared ``properties`` unless its schema allows
    them (``additionalProperties``): a forced call's arguments still validate against the schema as given, and a
    small model cannot pad them with keys of its own."""
    guidance = {"lenient": True, "whitespace_pattern": JSON_WHITESPACE}
    own = schema.get("x-guidance")
    out = {**schema, "x-guidance": {**guidance, **own} if isinstance(own, dict) else guidance}
    if "properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _tools_grammar(
    model: Model, syntax: ToolSyntax, tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool
) -> Grammar:
    """The Lark grammar forcing a call (``required``: any of `tools`; or the one named; several in a row when
    `parallel`) in the model's syntax."""
    shaped = []
    for tool in tools:
        fn = dict(tool.get("function", {}))
        params = fn.get("parameters")
        fn["parameters"] = lenient(params if isinstance(params, dict) and params else {"type": "object"})
        shaped.append({**tool, "function": fn})
    tok = model.tokenizer
    special = []
    for text in CALL_MARKERS:
        i = tok.token_id(text)
        if i is not None and tok.attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN):
            special.append(text)
    try:
        text = syntax.grammar(shaped, choice, parallel, special=special)
    except ValueError as exc:
        raise GrammarError(str(exc), param="tool_choice") from None
    try:
        return _lark(text)
    except GrammarError as exc:
        exc.param = "tools"
        raise


@functools.lru_cache(maxsize=64)
def _lark(text: str) -> Grammar:
    """A tools grammar compiled once (a client sends the same tools with every request; ~10 ms each)."""
    return Grammar.lark(text)


def _with_text_bias(model: Model, sampling: SamplingParams, bias_text: Sequence[tuple[str, float]]) -> SamplingParams:
    """`sampling` with every token of each biased string added to its logit bias (llama-server's rule)."""
    if not bias_text:
        return sampling
    pairs = dict(sampling.logit_bias)
    for text, bias in bias_text:
        for t in model.tokenizer.encode(text, add_special=False):
            pairs[t] = bias
    return replace(sampling, logit_bias=tuple(pairs.items()))
