"""Streamed tool calls on /v1/chat/completions as OpenAI streams them (a head per call, then its arguments in
fragments as tokens arrive), read with the official openai client against the daemon on SmolLM2 (CPU)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from engine import Model
from engine.tool_stream import CallDelta
from genie_supervisor.api.generation import Result
from genie_supervisor.api.openai_routes import ChatFormat
from genie_supervisor.llm.serving import Piece
from tests.serving_daemon import api, daemon, model, oa
from tests.test_api_tools import SCHEMAS, TOOLS, TOOLS_AND_PROMPTS

__all__ = ["api", "daemon", "model", "oa"]  # the module's fixtures

pytestmark = pytest.mark.timeout(600)


def _chunks(oa: openai.OpenAI, **request: Any) -> list[Any]:
    return list(oa.chat.completions.create(**request, stream=True))


def _gather(chunks: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The calls of a stream gathered by index, checking OpenAI's shape on the way: a call's first delta has
    its index, id, type function, name and empty arguments; later ones the index and an arguments fragment;
    and, as Home Assistant's consumers need, every chunk from a call's head to the finish is a call delta."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            deltas = choice.delta.tool_calls or []
            if choice.finish_reason is not None:
                finish = choice.finish_reason
            elif calls:
                assert deltas and deltas[0].function is not None, chunk  # nothing else once a call has begun
            for d in deltas:
                if d.index not in calls:
                    assert d.index == len(calls) and d.id and d.id.startswith("call_") and d.type == "function", d
                    assert d.function is not None and d.function.name and d.function.arguments == "", d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "fragments": []}
                else:
                    assert d.index == len(calls) - 1, d  # a call ends before the next begins
                    assert d.id is None and d.function is not None and d.function.name is None, d
                    calls[d.index]["fragments"].append(d.function.arguments)
    return [calls[i] for i in sorted(calls)], finish


def test_argument_fragments_join_to_the_whole_arguments_for_the_same_seed(oa: openai.OpenAI) -> None:
    """Named calls at temperature 0.8: the streamed fragments join to exactly the non-streamed arguments of the
    same seed, and each call's arguments arrive in more than one fragment."""
    for k, (tool, prompt) in enumerate(TOOLS_AND_PROMPTS[:6]):
        name = tool["function"]["name"]
        request: dict[str, Any] = dict(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            temperature=0.8,
            seed=300 + k,
            max_tokens=96,
        )
        whole = oa.chat.completions.create(**request).choices[0]
        calls, finish = _gather(_chunks(oa, **request))
        assert finish == whole.finish_reason == "tool_calls"
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert [(c["name"], "".join(c["fragments"])) for c in calls] == expected, (calls, expected)
        assert len(calls[0]["fragments"]) > 1, calls
        jsonschema.validate(json.loads("".join(calls[0]["fragments"])), SCHEMAS[name])


def _no_end(model: Model) -> dict[str, int]:
    """A logit_bias banning every end-of-generation token: a forced answer has to go on with another call."""
    return {str(t): -100 for t in model.tokenizer.eog_ids}


def test_parallel_calls_stream_one_after_another_with_their_indexes(oa: openai.OpenAI, model: Model) -> None:
    """tool_choice required with parallel calls and no way to end: calls stream at indexes 0, 1, ... one after
    the other; those the non-streamed answer of the same seed holds are equal, the last may be cut off."""
    request: dict[str, Any] = dict(
        model="default",
        messages=[{"role": "user", "content": "Turn off the kitchen and the bedroom lights"}],
        tools=TOOLS[:1],
        tool_choice="required",
        parallel_tool_calls=True,
        logit_bias=_no_end(model),
        temperature=0.8,
        seed=7,
        max_tokens=120,
    )
    whole = oa.chat.completions.create(**request).choices[0]
    calls, _finish = _gather(_chunks(oa, **request))
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert len(expected) >= 2 and len(calls) in (len(expected), len(expected) + 1), (calls, expected)
    assert [(c["name"], "".join(c["fragments"])) for c in calls[: len(expected)]] == expected
    assert len({c["id"] for c in calls}) == len(calls)


def test_the_openai_stream_helper_parses_streamed_calls(oa: openai.OpenAI) -> None:
    """client.chat.completions.stream with a strict tool: argument delta events as tokens arrive, a done event
    and a final completion whose parsed arguments validate against the tool's schema."""
    tool = json.loads(json.dumps(TOOLS[1]))
    tool["function"]["strict"] = True
    tool["function"]["parameters"]["additionalProperties"] = False
    with oa.chat.completions.stream(
        model="default",
        messages=[{"role": "user", "content": TOOLS_AND_PROMPTS[1][1]}],
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "set_brightness"}},
        parallel_tool_calls=False,
        temperature=0.8,
        seed=5,
        max_tokens=96,
    ) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(deltas) > 1 and len(done) == 1 and done[0].name == "set_brightness"
    call = (final.choices[0].message.tool_calls or [])[0]
    assert call.function.arguments == "".join(d.arguments_delta for d in deltas) == done[0].arguments
    assert call.function.parsed_arguments == json.loads(call.function.arguments)
    jsonschema.validate(call.function.parsed_arguments, SCHEMAS["set_brightness"])


def test_content_after_a_streamed_call_comes_with_the_finish() -> None:
    """Text the model writes after a streamed call goes in the finish chunk, so that a client gathering calls by
    index sees only call deltas between a call's head and the finish; before any call, content streams."""
    fmt = ChatFormat(include_usage=False)
    assert fmt.piece("m", Piece("Sure.")) is not None
    events = fmt.calls("m", [CallDelta(0, "", "f", "call_1"), CallDelta(0, '{"a": 1}')])
    assert [e["choices"][0]["delta"]["tool_calls"][0]["index"] for e in events] == [0, 0]
    assert fmt.piece("m", Piece(" Done.")) is None
    result = Result("m", content="Sure.\nDone.")
    finish = fmt.end(result)[0]
    assert isinstance(finish, dict)
    assert finish["choices"][0]["delta"] == {"content": " Done."} and finish["choices"][0]["finish_reason"] == "stop"
