"""Constrained output through the API on the CUDA backend: the daemon started from a config with
``engine.backend: cupy`` on a synthetic GGUF (random weights; its byte-level vocabulary has a token for every
character JSON needs), read with the official openai client: JSON-schema answers, forced tool calls and
logit_bias, as tests/test_api_constrained.py and tests/test_api_tools.py check them on the CPU.

A random model pads every place JSON allows whitespace up to the grammar's bound, so answers get room
(``max_tokens`` 1,500; a 4,096-token context, since the tools prompt is long in a byte-level
vocabulary). Runs only where CuPy and a CUDA device work (`pytest -m gpu`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.gpu import require_cuda

require_cuda()

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402

from engine.synth import write_synthetic_gguf  # noqa: E402
from genie_supervisor.app import Supervisor  # noqa: E402
from tests.daemon import write_config, write_policy  # noqa: E402
from tests.serving_daemon import api, oa, threaded_daemon  # noqa: E402
from tests.test_api_constrained import SCHEMAS as CPU_SCHEMAS  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

__all__ = ["api", "oa"]  # the module's fixtures (their `daemon` is this module's)

SHAPE = dict(n_layers=2, n_embd=256, n_ff=512, n_heads=4, n_kv_heads=2, n_vocab=5000)
ROOMY = 1500
"""max_tokens of a constrained answer (see the module's docstring)."""

SCHEMAS = [schema for k, (schema, _prompt) in enumerate(CPU_SCHEMAS) if k not in (2, 10)]
"""The CPU test's schemas (nested objects, arrays, enums with a null, required keys, bounded numbers, short
strings, a pattern) but for the two with a number of any precision, whose digits a random model never ends."""

TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"Set the {name[4:]}", "parameters": schema}}
    for name, (schema, _prompt) in (("set_level", CPU_SCHEMAS[13]), ("set_color", CPU_SCHEMAS[16]))
]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    """The daemon on the cupy backend serving a synthetic Qwen3-shaped model, run by a thread of its own."""
    tmp = tmp_path_factory.mktemp("gpu_api")
    model = write_synthetic_gguf(tmp / "synth.gguf", "qwen3", weight_type="Q4_K", seed=11, **SHAPE)
    cfg = write_config(
        tmp / "supervisor.yaml", write_policy(tmp / "p.yaml"), model=model, engine="backend: cupy, n_ctx: 4096"
    )
    with threaded_daemon(cfg) as sup:
        yield sup


def test_the_daemon_serves_the_model_on_the_gpu(api: httpx.Client) -> None:
    """The model answering is the one loaded on the cupy backend."""
    model = api.get("/v1/models").json()["data"][0]
    assert (model["state"], model["backend_identity"]) == ("ready", "builtin/cupy"), model


def test_json_schema_answers_validate(oa: openai.OpenAI) -> None:
    """response_format json_schema on the GPU, temperature 0 and 0.8 in turn: every answer ends by itself and
    validates against its schema."""
    for k, schema in enumerate(SCHEMAS):
        fmt: Any = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema, "strict": True}}
        r = oa.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format=fmt,
            temperature=0.8 * (k % 2),
            seed=k,
            max_tokens=ROOMY,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (k, choice)
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def _call(oa: openai.OpenAI, choice: Any, seed: int, stream: bool = False) -> Any:
    return oa.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Set the lights."}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        parallel_tool_calls=False,
        temperature=0.8,
        seed=seed,
        max_tokens=ROOMY,
        stream=stream,
    )


def test_required_and_named_tool_calls_validate_and_stream_the_same(oa: openai.OpenAI) -> None:
    """tool_choice required and a named tool on the GPU: one call whose arguments validate against its tool's
    schema; streamed, the same call arrives in more than one arguments fragment."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "set_color"}}]):
        whole = _call(oa, choice, seed).choices[0]
        assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls or []) == 1, whole
        call = (whole.message.tool_calls or [])[0]
        assert choice == "required" or call.function.name == "set_color"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        fragments, name = [], None
        for chunk in _call(oa, choice, seed, stream=True):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name = name or (d.function.name if d.function else None)
                if d.function is not None and d.function.arguments:
                    fragments.append(d.function.arguments)
        assert name == call.function.name and "".join(fragments) == call.function.arguments and len(fragments) > 1


LETTERS = {"grammar": "root ::= [a-z]+"}
"""A grammar whose tokens all have text, each its own (a random model's first choice is otherwise often one of the
synthetic vocabulary's unused tokens, which all spell nothing)."""


def test_logit_bias_of_minus_100_removes_the_token(oa: openai.OpenAI, api: httpx.Client) -> None:
    """The token greedy decoding starts with (its id from /completion's tokens) never comes at -100, through the
    openai client and llama-server's /completion, at temperature 0 and 0.8."""
    prompt = "The weather today is"
    first = api.post("/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0, **LETTERS}).json()
    banned, text = first["tokens"][0], first["content"]
    plain = oa.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0, extra_body=LETTERS)
    assert plain.choices[0].text == text != ""
    for seed, temperature in enumerate((0.0, 0.8, 0.8)):
        r = oa.completions.create(
            model="default",
            prompt=prompt,
            max_tokens=1,
            temperature=temperature,
            seed=seed,
            logit_bias={str(banned): -100},
            extra_body=LETTERS,
        )
        body = {"prompt": prompt, "n_predict": 1, "temperature": temperature, "seed": seed, **LETTERS}
        again = api.post("/completion", json={**body, "logit_bias": [[banned, -100]]}).json()
        assert r.choices[0].text not in ("", text) and again["tokens"][0] != banned, (r, again)
