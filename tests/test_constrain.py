"""Constrained decoding on the real SmolLM2 and Gemma 3 models (CPU): JSON schemas, JSON objects,
GBNF, Lark and regex grammars through llguidance masks; grammar errors carry llguidance's message."""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import jsonschema
import numpy as np
import pytest

from engine import Grammar, GrammarError, SamplingParams
from engine.constrain import mask_words
from engine.sampler import allowed_tokens
from tests.models import GEMMA3, SMOLLM2, shared_model

pytestmark = pytest.mark.timeout(300)

MODELS = {"smollm2": SMOLLM2, "gemma3": GEMMA3}

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    "enum": {
        "type": "object",
        "properties": {"room": {"enum": ["kitchen", "bedroom", "hall"]}, "on": {"type": "boolean"}},
        "required": ["room", "on"],
        "additionalProperties": False,
    },
    "bounds": {
        "type": "object",
        "properties": {
            "temperature": {"type": "integer", "minimum": 15, "maximum": 30},
            "level": {"type": "number", "minimum": 0, "maximum": 1},
            "unit": {"const": "C"},
        },
        "required": ["temperature", "level", "unit"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "nested": "Give me a user as JSON.",
    "array": "List a few small numbers as a JSON array.",
    "enum": "Turn on the kitchen light. Answer in JSON.",
    "bounds": "Set the heating to 21 degrees. Answer in JSON.",
}


def _model(name: str):  # type: ignore[no-untyped-def]
    return shared_model(MODELS[name])


async def _run(model, prompt: str, grammar: Grammar, **sampling: Any):  # type: ignore[no-untyped-def]
    """The finished generation of `prompt` (a chat turn) constrained by `grammar`."""
    constraint = await anyio.to_thread.run_sync(model.constrainer.start, grammar)
    ids = model.encode_chat([{"role": "user", "content": prompt}])
    gen = model.generate(ids, SamplingParams(**{"max_tokens": 80, "seed": 7, **sampling}), constraint=constraint)
    events = [ev async for ev in gen]
    return gen, events


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("schema_name", sorted(SCHEMAS))
async def test_json_schema_output_validates(model_name: str, schema_name: str) -> None:
    """Greedy and sampled (temperature 0.8) generations under a JSON schema end by themselves and
    parse as instances of the schema (nested objects, arrays, enums, required keys, bounds)."""
    model, schema = _model(model_name), SCHEMAS[schema_name]
    for temperature in (0.0, 0.8):
        gen, _ = await _run(model, PROMPTS[schema_name], Grammar.json_schema(schema), temperature=temperature)
        assert gen.finish_reason == "stop", (temperature, gen.text)
        jsonschema.validate(json.loads(gen.text), schema)


async def test_json_object_gives_an_object() -> None:
    """json_object mode gives one JSON object that parses, greedy and sampled."""
    for temperature in (0.0, 0.8):
        prompt = 'Reply with exactly this JSON: {"ok": true}'
        gen, _ = await _run(_model("smollm2"), prompt, Grammar.json_object(), temperature=temperature, max_tokens=40)
        assert gen.finish_reason == "stop", gen.text
        assert isinstance(json.loads(gen.text), dict)


@pytest.mark.parametrize("model_name", sorted(MODELS))
async def test_gbnf_and_regex_grammars_match(model_name: str) -> None:
    """A llama.cpp GBNF grammar and a regex constrain the whole output, which stops when they end."""
    model = _model(model_name)
    gbnf = 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'
    gen, _ = await _run(model, "Is the sky blue?", Grammar.gbnf(gbnf), temperature=0.0)
    assert gen.finish_reason == "stop" and re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", gen.text), gen.text
    gen, _ = await _run(model, "What year is it?", Grammar.regex(r"[0-9]{4}"), temperature=0.8)
    assert gen.finish_reason == "stop" and re.fullmatch(r"[0-9]{4}", gen.text), gen.text


async def test_lark_grammar_with_a_json_value() -> None:
    """A Lark grammar embedding `%json` gives its literal text followed by a valid instance."""
    schema = {
        "type": "object",
        "properties": {"on": {"type": "boolean"}},
        "required": ["on"],
        "additionalProperties": False,
    }
    lark = 'start: "light=" obj\nobj: %json ' + json.dumps(schema)
    gen, _ = await _run(_model("smollm2"), "Turn the light on.", Grammar.lark(lark), temperature=0.0)
    assert gen.finish_reason == "stop" and gen.text.startswith("light="), gen.text
    jsonschema.validate(json.loads(gen.text.removeprefix("light=")), schema)


def test_end_of_generation_is_allowed_only_where_the_grammar_accepts() -> None:
    """The mask leaves out every end-of-generation id until the grammar can end, then allows them."""
    model = _model("smollm2")
    c = model.constrainer.start(Grammar.regex("[a-z]+"))
    eog = sorted(model.tokenizer.eog_ids)
    c.fill(c.mask)
    allowed = allowed_tokens(c.mask, model.info.n_vocab)
    assert c.mask.shape == (mask_words(model.info.n_vocab),) and not allowed[eog].any()
    letter = model.tokenizer.token_id("a")
    assert letter is not None and allowed[letter]
    c.advance(letter)
    c.fill(c.mask)
    assert allowed_tokens(c.mask, model.info.n_vocab)[eog].all() and c.accepting and not c.done


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: Grammar.json_schema({"type": "foo"}), "Invalid type"),
        (lambda: Grammar.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (lambda: Grammar.json_schema({"$ref": "#/defs/missing"}), "/defs/missing"),
        (lambda: Grammar.gbnf("root ::= missing"), "Rule 'missing' not found"),
        (lambda: Grammar.lark("start: foo"), 'unknown name: "foo"'),
        (lambda: Grammar.regex("a(b"), "unclosed group"),
    ],
)
def test_bad_grammars_raise_grammar_error_with_the_library_message(make: Any, expected: str) -> None:
    """A schema or grammar llguidance rejects raises GrammarError carrying llguidance's message."""
    with pytest.raises(GrammarError, match=re.escape(expected)):
        make()


def test_strict_false_ignores_unimplemented_keywords_and_vocabulary_checks() -> None:
    """strict=False ignores keywords llguidance lacks; a Lark grammar naming a special token the
    vocabulary lacks fails `check` and `start` with GrammarError."""
    Grammar.json_schema({"type": "array", "uniqueItems": True}, strict=False)
    model = _model("smollm2")
    good, bad = Grammar.lark('start: "x" <|im_end|>'), Grammar.lark('start: "x" <|no_such_token|>')
    model.constrainer.check(good)
    for call in (model.constrainer.check, model.constrainer.start):
        with pytest.raises(GrammarError, match="no_such_token"):
            call(bad)


async def test_logit_bias_minus_inf_bans_the_greedy_token() -> None:
    """A -inf bias on the token greedy would pick makes greedy pick the runner-up instead."""
    model = _model("smollm2")
    ids = model.encode_chat([{"role": "user", "content": "Say hello."}])
    row = model.logits(ids, last_n=1)[0]
    best, second = (int(i) for i in np.argsort(-row, kind="stable")[:2])
    gen = model.generate(ids, SamplingParams(temperature=0, max_tokens=1, logit_bias={best: float("-inf")}))
    assert [ev.id async for ev in gen] == [second]


async def test_logit_bias_outside_the_vocabulary_is_a_grammar_error() -> None:
    """A logit_bias id past the vocabulary raises GrammarError naming the field."""
    model = _model("smollm2")
    with pytest.raises(GrammarError, match="outside the vocabulary") as err:
        model.generate([1, 2], SamplingParams(logit_bias={model.info.n_vocab: 1.0}))
    assert err.value.param == "logit_bias"


async def test_logprobs_are_the_log_softmax_of_the_logits() -> None:
    """Each token carries its log-softmax log-probability and the top n, most likely first; the
    first token's match the full-vocabulary log-softmax of the prompt's logits."""
    model = _model("smollm2")
    ids = model.encode_chat([{"role": "user", "content": "Name a colour."}])
    gen = model.generate(ids, SamplingParams(temperature=0, max_tokens=4, logprobs=5))
    events = [ev async for ev in gen]
    row = model.logits(ids, last_n=1)[0].astype(np.float64)
    ref = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
    first = events[0]
    assert first.logprob is not None and abs(first.logprob - ref[first.id]) < 1e-3
    assert [t for t, _ in first.top] == [int(i) for i in np.argsort(-ref, kind="stable")[:5]]
    for ev in events:
        lps = [lp for _, lp in ev.top]
        assert len(lps) == 5 and lps == sorted(lps, reverse=True) and ev.top[0] == (ev.id, ev.logprob)
        assert sum(np.exp(lps)) <= 1.0 + 1e-6
