"""Tools and ``format`` on the Ollama routes, on SmolLM2, checked with the ollama client's types and jsonschema."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import jsonschema
import ollama
import pytest

from tests.daemon import client, make_supervisor, write_policy
from tests.models import SMOLLM2, require, shared_model

pytestmark = pytest.mark.timeout(180)


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


NAME = {"type": "string", "maxLength": 32}
"""A name argument (bounded, so that a call at temperature 0.8 ends well within num_predict)."""
TOOLS = [
    _tool(
        "HassTurnOff",
        "Turns off a device or entity",
        {"name": NAME, "domain": {"type": "string", "enum": ["light", "switch", "fan"]}},
        ["name"],
    ),
    _tool(
        "HassLightSet",
        "Sets the brightness of a light",
        {"name": NAME, "brightness": {"type": "integer", "minimum": 0, "maximum": 100}},
        ["name", "brightness"],
    ),
    _tool(
        "HassClimateSetTemperature",
        "Sets the target temperature",
        {"temperature": {"type": "number", "minimum": 5, "maximum": 35}, "area": NAME},
        ["temperature"],
    ),
]
PROMPTS = ["Turn off the kitchen light.", "Dim the bedroom light to 30 percent.", "Make it 21 degrees in here."]
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"mood": {"type": "string", "enum": ["happy", "sad", "calm"]}, "sure": {"type": "boolean"}},
        "required": ["mood", "sure"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3}
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "room": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "lights": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["name", "lights"],
                "additionalProperties": False,
            }
        },
        "required": ["room"],
        "additionalProperties": False,
    },
]


@asynccontextmanager
async def _serving(tmp_path: Path) -> AsyncIterator[tuple[Any, httpx.AsyncClient, ollama.AsyncClient]]:
    """The shared SmolLM2 in a daemon, a plain HTTP client and the ollama client against it."""
    model = shared_model(require(SMOLLM2))
    policy = write_policy(tmp_path / "p.yaml")
    async with (
        make_supervisor(
            tmp_path, policy=policy, model=SMOLLM2, engine="n_ctx: 2048", model_loader=lambda *_a, **_k: model
        ) as sup,
        client(sup) as http,
        ollama.AsyncClient(host=str(http.base_url), timeout=60) as oc,
    ):
        http.timeout = httpx.Timeout(60)
        yield model, http, oc


def _check_calls(calls: Any, tools: list[dict[str, Any]]) -> None:
    """Every call names one of `tools` and its arguments validate against that tool's schema."""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls, "no tool call came back"
    for call in calls:
        jsonschema.validate(call.function.arguments, by_name[call.function.name])


async def test_forced_tool_calls_validate_and_stream_the_same(tmp_path: Path) -> None:
    """tool_choice required or named (an extension) gives calls whose arguments validate, arguments as objects;
    streamed and whole answers carry the same calls at temperature 0."""
    with anyio.fail_after(170):
        async with _serving(tmp_path) as (_model, http, _oc):
            for i, prompt in enumerate(PROMPTS):
                named = {"type": "function", "function": {"name": TOOLS[i]["function"]["name"]}}
                for choice in ("required",) if i == 0 else (named,):
                    body = {
                        "model": "default",
                        "messages": [{"role": "user", "content": prompt}],
                        "tools": TOOLS,
                        "tool_choice": choice,
                        "parallel_tool_calls": False,
                        "stream": False,
                        "options": {"temperature": 0.8, "num_predict": 96, "seed": 11 + i},
                    }
                    r = await http.post("/api/chat", json=body)
                    assert r.status_code == 200, r.text
                    reply = ollama.ChatResponse(**r.json())  # the client's own types accept it
                    _check_calls(reply.message.tool_calls, TOOLS if choice == "required" else [TOOLS[i]])
                    assert isinstance(r.json()["message"]["tool_calls"][0]["function"]["arguments"], dict)

            greedy = {**body, "options": {"temperature": 0, "num_predict": 96}}
            whole = ollama.ChatResponse(**(await http.post("/api/chat", json=greedy)).json())
            async with http.stream("POST", "/api/chat", json={**greedy, "stream": True}) as s:
                lines = [ollama.ChatResponse(**json.loads(line)) async for line in s.aiter_lines() if line]
            streamed = [c for line in lines for c in line.message.tool_calls or []]
            assert [(c.function.name, c.function.arguments) for c in streamed] == [
                (c.function.name, c.function.arguments) for c in whole.message.tool_calls or []
            ]
            assert lines[-1].done and not any(line.done for line in lines[:-1])


async def test_tools_reach_the_prompt_and_a_tool_result_continues_the_chat(tmp_path: Path) -> None:
    """With the ollama client, tools lengthen the prompt; a history with a call and its result (as Home Assistant
    sends it) is answered."""
    with anyio.fail_after(120):
        async with _serving(tmp_path) as (_model, _http, oc):
            ask = [{"role": "user", "content": PROMPTS[0]}]
            options = {"temperature": 0, "num_predict": 8}
            plain = await oc.chat(model="default", messages=ask, options=options)
            with_tools = await oc.chat(model="default", messages=ask, tools=TOOLS, options=options)
            assert (with_tools.prompt_eval_count or 0) > (plain.prompt_eval_count or 0) + 50

            history = [
                *ask,
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "HassTurnOff", "arguments": {"name": "kitchen light"}}}],
                },
                {"role": "tool", "content": json.dumps({"success": True, "data": "light.kitchen is off"})},
            ]
            after = await oc.chat(model="default", messages=history, tools=TOOLS, options=options, stream=True)
            parts = [p async for p in after]
            assert parts[-1].done and (parts[-1].prompt_eval_count or 0) > (with_tools.prompt_eval_count or 0)
            assert "".join(p.message.content or "" for p in parts) or any(p.message.tool_calls for p in parts)


async def test_format_schema_and_json_give_valid_instances(tmp_path: Path) -> None:
    """format as a JSON schema gives instances that validate (chat and generate, streamed or not, temperature 0.8);
    format "json" gives a JSON object; a schema the grammar library rejects is a 400 naming format."""
    with anyio.fail_after(170):
        async with _serving(tmp_path) as (_model, http, oc):
            for i, schema in enumerate(SCHEMAS):
                options = {"temperature": 0.8, "num_predict": 160, "seed": 7 + i}  # fixed: the same tokens each run
                ask = [{"role": "user", "content": "Answer in JSON."}]
                if i % 2:
                    parts = [
                        p async for p in await oc.chat("default", ask, format=schema, options=options, stream=True)
                    ]
                    text = "".join(p.message.content or "" for p in parts)
                else:
                    text = (await oc.chat("default", ask, format=schema, options=options)).message.content or ""
                jsonschema.validate(json.loads(text), schema)
            generated = await oc.generate("default", "Describe a cat.", format=SCHEMAS[0], options=options)
            jsonschema.validate(json.loads(generated.response or ""), SCHEMAS[0])
            greedy = {"temperature": 0, "num_predict": 160}
            free = await oc.generate("default", "Describe a cat in JSON.", format="json", options=greedy)
            assert free.done_reason == "stop" and isinstance(json.loads(free.response or ""), dict)

            bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
            with pytest.raises(ollama.ResponseError) as refused:
                await oc.chat("default", [{"role": "user", "content": "hi"}], format=bad)
            assert refused.value.status_code == 400 and refused.value.error.startswith("format:")
            r = await http.post(
                "/api/chat",
                json={
                    "model": "default",
                    "messages": [{"role": "user", "content": "x"}],
                    "tools": TOOLS,
                    "tool_choice": {"function": {"name": "nope"}},
                },
            )
            assert r.status_code == 400 and "tool_choice" in r.json()["error"]
