"""Tool calling on /v1/chat/completions with the official openai client, against the daemon on SmolLM2 (CPU)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from engine import Model
from engine.tool_calls import SYNTAXES
from genie_supervisor.api.generation import Result, ToolSplitter
from genie_supervisor.api.schemas import ChatRequest
from genie_supervisor.llm.serving import Piece
from genie_supervisor.llm.upstream import openai_message
from tests.serving_daemon import api, daemon, model, oa

__all__ = ["api", "daemon", "model", "oa"]  # the module's fixtures

pytestmark = pytest.mark.timeout(600)


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": required or list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


ROOMS = {"type": "string", "enum": ["kitchen", "bedroom", "living_room", "office"]}
TEXT = {"type": "string", "minLength": 1, "maxLength": 24}

TOOLS_AND_PROMPTS: list[tuple[dict[str, Any], str]] = [
    (
        _tool("set_light", "Turn a light on or off", {"room": ROOMS, "on": {"type": "boolean"}}),
        "Turn off the kitchen light",
    ),
    (
        _tool(
            "set_brightness",
            "Dim a light",
            {"room": ROOMS, "percent": {"type": "integer", "minimum": 0, "maximum": 100}},
        ),
        "Dim the bedroom light to 30 percent",
    ),
    (
        _tool("set_temperature", "Set the thermostat", {"celsius": {"type": "number", "minimum": 5, "maximum": 30}}),
        "Make it 21 degrees",
    ),
    (
        _tool("start_timer", "Start a timer", {"minutes": {"type": "integer", "minimum": 1, "maximum": 120}}),
        "Timer for ten minutes",
    ),
    (_tool("play_music", "Play music", {"artist": TEXT}), "Play some Beatles"),
    (
        _tool("set_volume", "Set the speaker volume", {"level": {"type": "integer", "minimum": 0, "maximum": 10}}),
        "Volume to 4",
    ),
    (
        _tool(
            "lock_door",
            "Lock or unlock a door",
            {"door": {"type": "string", "enum": ["front", "back", "garage"]}, "locked": {"type": "boolean"}},
        ),
        "Lock the front door",
    ),
    (_tool("get_weather", "Weather for a city", {"city": TEXT}), "What's the weather in Paris?"),
    (
        _tool(
            "add_to_list",
            "Add an item to the shopping list",
            {"item": TEXT, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        ),
        "Add two apples to my shopping list",
    ),
    (_tool("send_message", "Send a text message", {"to": TEXT, "text": TEXT}), "Text Anna that I am late"),
    (
        _tool(
            "set_alarm",
            "Set an alarm",
            {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "minute": {"type": "integer", "minimum": 0, "maximum": 59},
            },
        ),
        "Wake me at 7:30",
    ),
    (
        _tool(
            "open_cover",
            "Open or close blinds",
            {"room": ROOMS, "position": {"type": "integer", "minimum": 0, "maximum": 100}},
        ),
        "Open the office blinds halfway",
    ),
    (
        _tool(
            "vacuum",
            "Start the vacuum robot",
            {"rooms": {"type": "array", "items": ROOMS, "minItems": 1, "maxItems": 3}},
        ),
        "Vacuum the kitchen and the office",
    ),
    (
        _tool("set_fan", "Set a fan speed", {"speed": {"type": "string", "enum": ["off", "low", "medium", "high"]}}),
        "Fan on high",
    ),
    (
        _tool(
            "get_time",
            "The current time in a time zone",
            {"zone": {"type": "string", "enum": ["UTC", "Europe/Paris", "America/New_York"]}},
        ),
        "What time is it in New York?",
    ),
    (
        _tool(
            "convert_units",
            "Convert a quantity",
            {"value": {"type": "integer", "minimum": 0, "maximum": 1000}, "unit_from": TEXT, "unit_to": TEXT},
        ),
        "How many feet is 3 meters?",
    ),
    (
        _tool(
            "scene", "Activate a scene", {"name": {"type": "string", "enum": ["movie", "dinner", "night", "morning"]}}
        ),
        "Movie time!",
    ),
    (
        _tool(
            "water_plants",
            "Water the garden",
            {
                "zone": {"type": "integer", "minimum": 1, "maximum": 4},
                "liters": {"type": "number", "minimum": 0.5, "maximum": 20},
            },
        ),
        "Water zone 2 with five liters",
    ),
    (
        _tool(
            "announce", "Say something on every speaker", {"message": TEXT, "urgent": {"type": "boolean"}}, ["message"]
        ),
        "Announce that dinner is ready",
    ),
    (
        _tool(
            "set_mode",
            "Set the alarm system mode",
            {
                "mode": {"type": "string", "enum": ["home", "away", "night", "off"]},
                "code": {"type": "string", "pattern": "^[0-9]{4}$"},
            },
        ),
        "Arm the alarm in away mode, code 1234",
    ),
]
"""Twenty tools, each with a request it answers (arguments bounded: enums, short strings, number ranges)."""

TOOLS = [t for t, _ in TOOLS_AND_PROMPTS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _named(name: str) -> Any:
    return {"type": "function", "function": {"name": name}}


def _check_call(choice: Any, names: set[str]) -> tuple[str, dict[str, Any]]:
    """The one call of `choice`, checked: finish tool_calls, a call id, its arguments valid for its tool."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) >= 1, choice
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return call.function.name, args


def _forced_calls(oa: openai.OpenAI, choice: Any, prompt: str, seed: int, **more: Any) -> Any:
    """The one choice of a chat answering `prompt` over the twenty tools under tool_choice `choice`, at temperature
    0.8 with `seed`."""
    r = oa.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice=choice,
        temperature=0.8,
        seed=seed,
        max_tokens=96,
        **more,
    )
    return r.choices[0]


def test_named_tool_calls_parse_and_validate_for_twenty_tools(oa: openai.OpenAI) -> None:
    """tool_choice naming each of 20 tools, at temperature 0.8: one call of that tool, arguments valid for its schema."""
    for k, (tool, prompt) in enumerate(TOOLS_AND_PROMPTS):
        name = tool["function"]["name"]
        assert _check_call(_forced_calls(oa, _named(name), prompt, k), {name})[0] == name


def test_required_tool_calls_parse_and_validate(oa: openai.OpenAI) -> None:
    """tool_choice required for each of 20 prompts at temperature 0.8: calls of listed tools with valid arguments."""
    for k, prompt in enumerate(p for _, p in TOOLS_AND_PROMPTS):
        choice = _forced_calls(oa, "required", prompt, 100 + k, parallel_tool_calls=False)
        _check_call(choice, set(SCHEMAS))
        assert len(choice.message.tool_calls or []) == 1


def _streamed(oa: openai.OpenAI, **request: Any) -> tuple[str, list[tuple[str, str]], str | None, list[str]]:
    """A streamed chat answer accumulated: content, calls (name, arguments), finish reason, call ids."""
    content, finish = "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in oa.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    ordered = [calls[i] for i in sorted(calls)]
    return content, [(c["name"], c["arguments"]) for c in ordered], finish, [c["id"] for c in ordered]


def test_streamed_and_whole_answers_carry_the_same_calls(oa: openai.OpenAI) -> None:
    """Greedy, named, required and auto: the streamed answer's content and calls equal the non-streamed one's."""
    messages = [{"role": "user", "content": "Turn off the kitchen light"}]
    for choice in (_named("set_light"), "required", "auto"):
        request: dict[str, Any] = dict(
            model="default", messages=messages, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=64
        )
        whole = oa.chat.completions.create(**request).choices[0]
        content, calls, finish, ids = _streamed(oa, **request)
        expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert calls == expected and finish == whole.finish_reason, (choice, calls, whole)
        assert content == (whole.message.content or ""), (choice, content, whole.message.content)
        assert all(i.startswith("call_") for i in ids)
        if choice != "auto":
            assert finish == "tool_calls" and len(calls) >= 1


def test_a_conversation_with_a_tool_result_reaches_the_prompt_and_continues(oa: openai.OpenAI, model: Model) -> None:
    """An assistant call (arguments as JSON text) and its tool result are rendered into the prompt; the answer goes on."""
    tools = TOOLS[7:8]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages: list[Any] = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "celsius": 23}'},
    ]
    r = oa.chat.completions.create(model="default", messages=messages, tools=tools, temperature=0, max_tokens=16)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = model.render_chat(ChatRequest.model_validate({"messages": messages}).prompt(), tools=tools)
    assert '{"sky": "sunny", "celsius": 23}' in rendered and '"city": "Paris"' in rendered
    assert r.usage is not None and r.usage.prompt_tokens == len(
        model.encode_chat(ChatRequest.model_validate({"messages": messages}).prompt(), tools=tools)
    )


def test_tool_choice_none_leaves_the_tools_out(oa: openai.OpenAI) -> None:
    """tool_choice none: the prompt is the one without tools and no call is parsed."""
    messages: list[Any] = [{"role": "user", "content": "Turn off the kitchen light"}]
    bare = oa.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=4)
    none = oa.chat.completions.create(
        model="default", messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=4
    )
    assert none.usage is not None and bare.usage is not None and none.usage.prompt_tokens == bare.usage.prompt_tokens
    assert (
        none.choices[0].message.tool_calls is None
        and none.choices[0].message.content == bare.choices[0].message.content
    )


CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
GOOD_TOOL = TOOLS[0]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": {"a": 1}}, "tools", "valid list"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
        ({"tools": [GOOD_TOOL, GOOD_TOOL]}, "tools[1].function.name", "given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
            "object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}},
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
            "strin",
        ),
        ({"tools": [GOOD_TOOL], "tool_choice": "always"}, "tool_choice", "tool_choice must be"),
        ({"tools": [GOOD_TOOL], "tool_choice": _named("nope")}, "tool_choice.function.name", "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"not": {"type": "null"}}},
                }
            },
            "response_format.json_schema.schema",
            "not",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": "p"}},
                }
            },
            "response_format.json_schema.schema",
            "",
        ),
        ({"grammar": "root ::= foo"}, "grammar", "foo"),
        ({"grammar": 'root ::= "a'}, "grammar", ""),
        ({"grammar": "start: <[99999999]>"}, "grammar", ""),
        ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar", "not both"),
        ({"tools": [GOOD_TOOL], "response_format": {"type": "json_object"}}, "response_format", "tools"),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{bad"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "not valid JSON",
        ),
        ({"logit_bias": {"42": "x"}}, "logit_bias", "number"),
        ({"logit_bias": {"42": 101}}, "logit_bias", "-100..100"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tools_schemas_grammars_and_biases_are_400s_naming_the_field(
    api: httpx.Client, body: dict[str, Any], param: str, words: str, stream: bool
) -> None:
    """Malformed tools, schemas or grammars the library rejects, bad biases: each a 400 naming the field, never a 500."""
    r = api.post("/v1/chat/completions", json={**CHAT, **body, "stream": stream})
    assert r.status_code == 400, r.text[:400]
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def _split(pieces: list[str]) -> tuple[str, Result]:
    """The content a stream passes on for `pieces` (hermes syntax), and the parsed result."""
    splitter = ToolSplitter(SYNTAXES["hermes"], parallel=True)
    sent = ""
    for p in pieces:
        out = splitter.push(Piece(p, (len(sent),)))
        sent += out.text if out is not None else ""
    result = Result("m", text="".join(pieces))
    rest, _deltas = splitter.finish(result)
    return sent + (rest.text if rest is not None else ""), result


def test_the_splitter_streams_content_up_to_a_call_and_parses_the_whole_text() -> None:
    """Content before a call is streamed, a possible opener is held back, the call comes out parsed with an id."""
    call = '<tool_call>\n{"name": "set_light", "arguments": {"room": "kitchen", "on": false}}\n</tool_call>'
    pieces = ["Let me ", "check.\n<to", "ol_c", "all>\n{", call[13:]]
    content, result = _split(pieces)
    assert content == "Let me check." == result.message
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("set_light", {"room": "kitchen", "on": False})]
    assert result.tool_calls[0].id is not None and result.tool_calls[0].id.startswith("call_")
    content, result = _split(["It is <to", "day, ", "sunny."])  # held back, then released as content
    assert content == "It is <today, sunny." and result.tool_calls == []


def test_a_tool_history_reaches_llama_server_with_arguments_as_json_text() -> None:
    """The llama_cpp backend sends an assistant's earlier calls as OpenAI writes them (arguments JSON text)."""
    messages: Any = [
        {"role": "user", "content": "Lights?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "f", "arguments": '{"on": true}'}}],
        },
    ]
    decoded = ChatRequest.model_validate({"messages": messages}).prompt()
    assert decoded[1]["tool_calls"][0]["function"]["arguments"] == {"on": True}
    sent = [openai_message(m) for m in decoded]
    assert sent[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": '{"on": true}'}}]
    assert sent[0] == decoded[0]
