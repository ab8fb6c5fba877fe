"""The OpenAI-compatible and llama-server routes on SmolLM2, through the official openai client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from tests.daemon import client, make_supervisor, write_policy
from tests.models import SMOLLM2, require, shared_model

pytestmark = pytest.mark.timeout(120)

MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


@asynccontextmanager
async def _serving_smollm2(tmp_path: Path) -> AsyncIterator[tuple[Any, Any, openai.AsyncOpenAI]]:
    """The shared SmolLM2, a daemon serving it, and the openai client against the daemon."""
    model = shared_model(require(SMOLLM2))
    policy = write_policy(tmp_path / "p.yaml")
    async with (
        make_supervisor(tmp_path, policy=policy, model=SMOLLM2, model_loader=lambda *_a, **_k: model) as sup,
        openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sup.http.port}/v1", api_key="x", max_retries=0) as oa,
    ):
        yield model, sup, oa


async def test_chat_streamed_text_equals_whole_text_and_usage_is_right(tmp_path: Path) -> None:
    """At temperature 0 the streamed chat text equals the non-streamed one; usage counts match the tokenizer."""
    with anyio.fail_after(100):
        async with _serving_smollm2(tmp_path) as (model, _sup, oa):
            other: Any = [{"role": "user", "content": "Hi"}]

            async def same_cache() -> None:
                # the engine reuses the KV of the previous request's common prefix, and a different
                # prefill split may round differently: give both requests the same cache state
                await oa.chat.completions.create(model="default", messages=other, max_tokens=1, temperature=0)

            request: dict[str, Any] = dict(model="default", messages=MESSAGES, max_tokens=8, temperature=0)
            await same_cache()
            whole = await oa.chat.completions.create(**request)
            text = whole.choices[0].message.content
            assert text and whole.choices[0].finish_reason in ("stop", "length")
            assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
            usage = whole.usage
            assert usage is not None
            assert usage.prompt_tokens == len(model.encode_chat(MESSAGES))
            assert usage.completion_tokens == len(model.tokenizer.encode(text, add_special=False)) <= 8
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

            await same_cache()
            stream = await oa.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
            pieces, finish, last_usage, roles = [], None, None, []
            async for chunk in stream:
                if chunk.usage is not None:
                    last_usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.role:
                        roles.append(choice.delta.role)
                    pieces.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
            assert "".join(pieces) == text
            assert roles == ["assistant"] and finish == whole.choices[0].finish_reason
            assert last_usage is not None and last_usage.completion_tokens == usage.completion_tokens
            assert last_usage.prompt_tokens == usage.prompt_tokens


async def test_completions_models_and_llama_completion_shape(tmp_path: Path) -> None:
    """/v1/completions streams and not, /v1/models lists the model ready, /completion answers in llama-server's shape."""
    with anyio.fail_after(100):
        async with _serving_smollm2(tmp_path) as (model, sup, oa), client(sup) as http:
            listed = await oa.models.list()
            assert [m.id for m in listed.data] == ["SmolLM2-135M-Instruct.Q4_1"]
            raw = (await http.get("/v1/models")).json()["data"][0]
            assert raw["state"] == "ready" and raw["backend"] == "builtin" and raw["role"] == "default"
            assert raw["memory"]["total_mb"] > 0

            prompt = "The capital of France is"
            whole = await oa.completions.create(model="default", prompt=prompt, max_tokens=5, temperature=0)
            assert whole.object == "text_completion" and whole.usage is not None
            assert whole.usage.prompt_tokens == len(model.tokenizer.encode(prompt))
            streamed = ""
            async for chunk in await oa.completions.create(
                model="default", prompt=prompt, max_tokens=5, temperature=0, stream=True
            ):
                streamed += "".join(c.text for c in chunk.choices)
            assert streamed == whole.choices[0].text

            r = await http.post("/completion", json={"prompt": prompt, "n_predict": 5, "temperature": 0})
            body = r.json()
            assert r.status_code == 200 and body["content"] == whole.choices[0].text
            assert body["stop"] is True and body["tokens_predicted"] == whole.usage.completion_tokens
            assert body["tokens_evaluated"] == whole.usage.prompt_tokens
            assert body["stop_type"] in ("eos", "limit", "word")
            assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"} <= set(
                body["timings"]
            )

            async with http.stream(
                "POST", "/completion", json={"prompt": prompt, "n_predict": 5, "temperature": 0, "stream": True}
            ) as s:
                events = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
            import json

            parsed = [json.loads(e) for e in events]
            assert all(p["stop"] is False for p in parsed[:-1]) and parsed[-1]["stop"] is True
            assert "".join(p["content"] for p in parsed) == body["content"]

            status = (await http.get("/status")).json()
            assert status["admission"]["running"] == 0 and status["models"][0]["in_flight"] == 0
            metrics = (await http.get("/metrics")).text
            assert (
                'genie_model_state{backend="builtin",model="SmolLM2-135M-Instruct.Q4_1",state="ready"} 1.0' in metrics
            )
            assert "genie_tokens_total" in metrics and "genie_gate_pauses" in metrics
            health = (await http.get("/health")).json()
            assert health["backend_kind"] == "builtin" and health["backend_identity"] == f"builtin/{health['backend']}"
