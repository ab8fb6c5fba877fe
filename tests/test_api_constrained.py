"""Constrained output, logit_bias and logprobs on the OpenAI routes, with the official openai client against the
daemon on SmolLM2 (CPU)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest

from engine import Model
from tests.serving_daemon import api, daemon, model, oa

__all__ = ["api", "daemon", "model", "oa"]  # the module's fixtures

pytestmark = pytest.mark.timeout(600)


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object schema as OpenAI's strict mode wants it: no keys beyond its properties."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "minLength": 1, "maxLength": 16}
COLOR = {"type": "string", "enum": ["red", "green", "blue"]}

SCHEMAS: list[tuple[dict[str, Any], str]] = [
    (_obj({"name": NAME}), "Give a name for a cat."),
    (_obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}), "How old is a typical grandmother?"),
    (_obj({"celsius": {"type": "number", "minimum": -40, "maximum": 50}}), "A warm summer day's temperature."),
    (_obj({"color": COLOR}), "The color of the sky."),
    (_obj({"ok": {"type": "boolean"}}), "Is water wet?"),
    (_obj({"name": NAME, "age": {"type": "integer", "minimum": 1, "maximum": 30}}), "Describe a dog."),
    (_obj({"city": NAME, "country": NAME}), "Name a city and its country."),
    (_obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}), "Three words about summer."),
    (
        _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 10}, "maxItems": 4}}),
        "Some scores out of ten.",
    ),
    (_obj({"owner": _obj({"name": NAME, "pets": {"type": "integer", "minimum": 0, "maximum": 9}})}), "A pet owner."),
    (
        _obj(
            {
                "point": _obj(
                    {
                        "x": {"type": "integer", "minimum": -99, "maximum": 99},
                        "y": {"type": "number", "minimum": -1, "maximum": 1},
                    }
                )
            }
        ),
        "A point on a plane.",
    ),
    (
        _obj(
            {
                "items": {
                    "type": "array",
                    "items": _obj({"item": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 5}}),
                    "minItems": 1,
                    "maxItems": 2,
                }
            }
        ),
        "A short shopping list.",
    ),
    (_obj({"name": NAME, "nickname": NAME}, required=["name"]), "A person, maybe with a nickname."),
    (
        _obj(
            {
                "level": {"type": "string", "enum": ["low", "medium", "high"]},
                "value": {"type": "integer", "minimum": 1, "maximum": 3},
            }
        ),
        "A risk level.",
    ),
    (_obj({"answer": {"enum": ["yes", "no", None]}}), "Will it rain tomorrow?"),
    (_obj({"percent": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.5}}), "A battery level."),
    (
        _obj(
            {
                "rgb": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 255},
                    "minItems": 3,
                    "maxItems": 3,
                }
            }
        ),
        "An RGB color.",
    ),
    (_obj({"when": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}), "A time of day, HH:MM."),
    (_obj({"light": _obj({"room": NAME, "on": {"type": "boolean"}, "color": COLOR})}), "A light's state."),
    (
        _obj(
            {
                "user": _obj(
                    {
                        "id": {"type": "integer", "minimum": 1, "maximum": 999},
                        "roles": {
                            "type": "array",
                            "items": {"type": "string", "enum": ["admin", "guest"]},
                            "maxItems": 2,
                        },
                    }
                )
            }
        ),
        "A user of a home system.",
    ),
]
"""Twenty schemas (nested objects, arrays, enums, required keys, numbers with bounds), each with a request."""


def _chat(oa: openai.OpenAI, prompt: str, **kw: Any) -> Any:
    return oa.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}], **kw)


def test_response_format_json_schema_gives_valid_instances_of_twenty_schemas(oa: openai.OpenAI) -> None:
    """response_format json_schema, temperature 0.7: each answer parses and validates against its schema."""
    for k, (schema, prompt) in enumerate(SCHEMAS):
        fmt: Any = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema, "strict": True}}
        r = _chat(oa, prompt, response_format=fmt, temperature=0.7, seed=k, max_tokens=128)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (k, choice)
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_object_and_llama_server_grammar_fields_constrain_the_chat(oa: openai.OpenAI, api: httpx.Client) -> None:
    """response_format json_object gives a JSON object; llama-server's grammar (GBNF) and json_schema fields apply."""
    r = _chat(
        oa,
        'Answer in JSON like {"name": "..."}: what is your name?',
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content or ""), dict)
    chat = {"messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 8, "temperature": 0.8}
    for seed in range(3):
        body = api.post("/v1/chat/completions", json={**chat, "seed": seed, "grammar": 'root ::= "yes" | "no"'}).json()
        assert body["choices"][0]["message"]["content"] in ("yes", "no"), body
    schema = _obj({"answer": {"type": "boolean"}})
    body = api.post("/v1/chat/completions", json={**chat, "max_tokens": 24, "json_schema": schema}).json()
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)


def test_logit_bias_of_minus_100_removes_the_token_greedy_picked(oa: openai.OpenAI, model: Model) -> None:
    """The token greedy decoding starts with never comes at -100, at temperature 0 and 0.8."""
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    ids = model.encode_chat(messages)
    first = int(np.argmax(model.logits(ids, last_n=1)[-1]))
    piece = list(model.tokenizer.token_to_bytes(first))
    plain = oa.chat.completions.create(model="default", messages=messages, max_tokens=1, temperature=0, logprobs=True)
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    assert plain.choices[0].logprobs.content[0].bytes == piece
    for seed, temperature in enumerate((0.0, 0.8, 0.8, 0.8)):
        r = oa.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=1,
            temperature=temperature,
            seed=seed,
            logprobs=True,
            logit_bias={str(first): -100},
        )
        assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content
        assert r.choices[0].logprobs.content[0].bytes != piece


def test_logit_bias_by_string_bans_each_of_its_tokens(api: httpx.Client) -> None:
    """llama-server's [[text, false]] form bans every token of the text (here the greedy continuation)."""
    prompt = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    plain = api.post("/v1/completions", json=prompt).json()["choices"][0]["text"]
    assert plain.strip()
    word = plain.split()[0]
    banned = api.post("/v1/completions", json={**prompt, "logit_bias": [[word, False], [" " + word, False]]}).json()
    assert not banned["choices"][0]["text"].strip().startswith(word), (plain, banned)


def test_chat_logprobs_have_openai_shape_streamed_and_not(oa: openai.OpenAI) -> None:
    """logprobs + top_logprobs: one entry per token, alternatives most likely first; a stream carries the same ones."""
    request: dict[str, Any] = dict(
        model="default",
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    oa.chat.completions.create(**request)  # the same cache state for the two compared requests
    whole = oa.chat.completions.create(**request)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.content is not None and whole.usage is not None
    assert len(lp.content) == whole.usage.completion_tokens
    for entry in lp.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].bytes == entry.bytes and entry.top_logprobs[0].logprob == pytest.approx(
            entry.logprob
        )
    assert bytes(b for e in lp.content for b in e.bytes or []).decode() == whole.choices[0].message.content
    streamed = []
    for chunk in oa.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in lp.content]


def test_completion_logprobs_have_the_legacy_shape(oa: openai.OpenAI) -> None:
    """/v1/completions logprobs n: tokens, token_logprobs, top_logprobs ({token: logprob}) and text_offset per token."""
    r = oa.completions.create(
        model="default", prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(
        1 <= len(top) <= 2 and max(top.values()) >= v - 1e-6
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
