"""The Ollama routes on SmolLM2, through the official ollama client (as Home Assistant's integration uses it)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import ollama
import pytest

from tests.daemon import client, make_supervisor, wait_for, write_policy
from tests.models import SMOLLM2, require, shared_model

pytestmark = pytest.mark.timeout(120)

NAME = "SmolLM2-135M-Instruct.Q4_1:latest"
MESSAGES: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 8, "seed": 1}


@asynccontextmanager
async def _serving(tmp_path: Path, **headers: str) -> AsyncIterator[tuple[Any, Any, ollama.AsyncClient]]:
    """The shared SmolLM2, a daemon serving it, and the ollama client against the daemon."""
    model = shared_model(require(SMOLLM2))
    policy = write_policy(tmp_path / "p.yaml")
    async with make_supervisor(
        tmp_path, policy=policy, model=SMOLLM2, engine="n_ctx: 1024", model_loader=lambda *_a, **_k: model
    ) as sup:
        assert sup.http is not None
        async with ollama.AsyncClient(host=f"http://127.0.0.1:{sup.http.port}", headers=headers, timeout=60) as oc:
            yield model, sup, oc


async def test_list_show_ps_and_version_describe_the_configured_model(tmp_path: Path) -> None:
    """list() names the model by id and role with GGUF details; show() gives its metadata; ps() the loaded one."""
    with anyio.fail_after(60):
        async with _serving(tmp_path) as (_model, sup, oc), client(sup) as http:
            listed = await oc.list()
            assert [m.model for m in listed.models] == [NAME, "default:latest"]
            details = listed.models[0].details
            assert details is not None and details.format == "gguf" and details.family == "llama"
            assert details.quantization_level == "Q4_1" and details.parameter_size == "135M"
            assert listed.models[0].size == SMOLLM2.stat().st_size and listed.models[0].digest

            shown = await oc.show("default")  # a role, without its tag
            assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
            assert "tokenizer.ggml.tokens" not in shown.modelinfo  # big arrays left out
            assert shown.capabilities == ["completion", "tools"] and shown.template
            assert shown.details is not None and shown.details.family == "llama"

            running = await oc.ps()
            assert [(m.model, m.context_length, m.size_vram) for m in running.models] == [(NAME, 1024, 0)]
            assert running.models[0].expires_at is not None and running.models[0].expires_at.year == 2318

            assert (await http.get("/api/version")).json()["version"]
            root = await http.get("/")
            assert root.status_code == 200 and root.text == "Ollama is running"
            assert (await http.head("/")).status_code == 200


async def test_chat_streamed_equals_whole_and_ends_with_counts(tmp_path: Path) -> None:
    """At temperature 0 the streamed chat content equals the non-streamed one; the last line is done with counts."""
    with anyio.fail_after(90):
        async with _serving(tmp_path) as (model, _sup, oc):
            warm = await oc.chat(model="default", messages=[{"role": "user", "content": "Hi"}], options=GREEDY)
            assert warm.done and warm.message.role == "assistant"  # both runs below start from the same cache

            whole = await oc.chat(model=NAME, messages=MESSAGES, options=GREEDY, stream=False)
            assert whole.done is True and whole.done_reason in ("stop", "length") and whole.message.content
            assert whole.model == NAME and whole.prompt_eval_count == len(model.encode_chat(MESSAGES))
            assert whole.eval_count is not None and 0 < whole.eval_count <= 8
            assert whole.total_duration is not None and whole.total_duration > 0

            await oc.chat(model="default", messages=[{"role": "user", "content": "Hi"}], options=GREEDY)
            lines = [part async for part in await oc.chat(model=NAME, messages=MESSAGES, options=GREEDY, stream=True)]
            assert all(not p.done for p in lines[:-1]) and lines[-1].done is True
            assert "".join(p.message.content or "" for p in lines) == whole.message.content
            assert lines[-1].eval_count == whole.eval_count and lines[-1].done_reason == whole.done_reason


async def test_generate_templates_the_prompt_unless_raw_and_streams_ndjson(tmp_path: Path) -> None:
    """generate() answers a templated prompt (and a raw one); curl's default is NDJSON streaming."""
    with anyio.fail_after(90):
        async with _serving(tmp_path) as (model, sup, oc), client(sup) as http:
            templated = await oc.generate(model="default", prompt="What is the capital of France?", options=GREEDY)
            assert templated.done and templated.response
            assert templated.prompt_eval_count == len(model.encode_chat(MESSAGES))

            prompt = "The capital of France is"
            raw = await oc.generate(
                model="default", prompt=prompt, raw=True, options={"temperature": 0, "num_predict": 4}
            )
            assert raw.prompt_eval_count == len(model.tokenizer.encode(prompt)) and (raw.eval_count or 0) <= 4

            async with http.stream(
                "POST",
                "/api/generate",
                json={
                    "model": "default",
                    "prompt": prompt,
                    "raw": True,
                    "options": {"temperature": 0, "num_predict": 4},
                },
            ) as s:
                assert s.headers["content-type"] == "application/x-ndjson"
                lines = [json.loads(line) async for line in s.aiter_lines() if line]
            assert lines[-1]["done"] is True and "".join(x["response"] for x in lines) == raw.response


async def test_pull_embed_and_errors_answer_as_ollama_does(tmp_path: Path) -> None:
    """pull succeeds for a served name and 404s otherwise; embed is 501; bad bodies 400; unknown models 404."""
    with anyio.fail_after(60):
        async with _serving(tmp_path) as (_model, sup, oc), client(sup) as http:
            assert (await oc.pull("default")).status == "success"
            statuses = [p.status async for p in await oc.pull(NAME.lower(), stream=True)]
            assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
            with pytest.raises(ollama.ResponseError) as missing:
                await oc.pull("llama3.2")
            assert missing.value.status_code == 404 and "cannot download" in missing.value.error

            with pytest.raises(ollama.ResponseError) as embed:
                await oc.embed(model="default", input="hello")
            assert embed.value.status_code == 501 and "embeddings" in embed.value.error

            with pytest.raises(ollama.ResponseError) as unknown:
                await oc.chat(model="llama3.2:latest", messages=MESSAGES)
            assert unknown.value.status_code == 404 and "llama3.2" in unknown.value.error

            r = await http.post("/api/chat", json={"model": "default", "messages": MESSAGES, "options": {"top_p": 7}})
            assert r.status_code == 400 and r.json()["error"].startswith("options.top_p")
            r = await http.post("/api/chat", content=b"{not json")
            assert r.status_code == 400 and isinstance(r.json()["error"], str)
            r = await http.post("/api/chat", json={"model": "default", "messages": MESSAGES, "think": True})
            assert r.status_code == 400 and "thinking" in r.json()["error"]
            r = await http.post("/api/chat", json={"model": "default", "messages": MESSAGES, "keep_alive": "soon"})
            assert r.status_code == 400 and "keep_alive" in r.json()["error"]


async def test_an_empty_chat_loads_the_model_and_priority_goes_through_admission(tmp_path: Path) -> None:
    """messages [] answers done_reason load; a priority class the policy lacks is refused as on the OpenAI routes."""
    with anyio.fail_after(60):
        async with _serving(tmp_path, **{"X-Genie-Priority": "nope"}) as (_model, sup, oc), client(sup) as http:
            loaded = await oc.chat(model="default", messages=[], keep_alive=-1)
            assert loaded.done and loaded.done_reason == "load"
            with pytest.raises(ollama.ResponseError) as refused:
                async for _ in await oc.chat(model="default", messages=MESSAGES, keep_alive="5m", stream=True):
                    pass
            assert refused.value.status_code == 400 and "nope" in refused.value.error
            r = await http.post("/api/chat", json={"model": "default", "messages": MESSAGES, "priority": "nope"})
            assert r.status_code == 400 and "nope" in r.json()["error"]


async def test_voice_priority_passes_the_stt_pause_while_tags_and_ps_answer_at_once(tmp_path: Path) -> None:
    """Under an STT pause a background chat stays parked, tags and ps still answer, a voice chat streams through."""
    with anyio.fail_after(100):
        async with (
            _serving(tmp_path) as (_model, sup, oc),
            client(sup) as http,
            ollama.AsyncClient(host=str(http.base_url), headers={"X-Genie-Priority": "voice"}) as voice,
            anyio.create_task_group() as tg,
        ):
            assert (await http.post("/v1/voice/events", json={"service": "stt", "event": "start"})).status_code == 200
            assert sup.gate.mode == "paused"
            background: list[Any] = []

            async def ask_in_background() -> None:
                async for part in await oc.chat(model="default", messages=MESSAGES, options=GREEDY, stream=True):
                    background.append(part)

            tg.start_soon(ask_in_background)
            assert await sup.gate.wait_parked(30)
            parked = len(background)  # lines sent before it parked (the prefill's first token, at most)
            with anyio.fail_after(5):
                assert [m.model for m in (await oc.list()).models] == [NAME, "default:latest"]
                assert [m.model for m in (await oc.ps()).models] == [NAME]
            reply = await voice.chat(model="default", messages=MESSAGES, options=GREEDY)
            assert reply.done and reply.message.content and sup.gate.mode == "paused"
            assert len(background) == parked <= 1, "the background chat decoded while paused"

            await http.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
            await wait_for(sup, lambda: bool(background) and bool(background[-1].done))
            assert (background[-1].eval_count or 0) > 0


async def test_logprobs_come_per_token_streamed_and_whole(tmp_path: Path) -> None:
    """logprobs with top_logprobs gives each generated token its log-probability and that many alternatives."""
    with anyio.fail_after(60):
        async with _serving(tmp_path) as (_model, _sup, oc):
            whole = await oc.chat(model="default", messages=MESSAGES, options=GREEDY, logprobs=True, top_logprobs=2)
            assert whole.logprobs is not None and len(whole.logprobs) == whole.eval_count
            assert all(lp.logprob <= 0 and len(lp.top_logprobs or []) == 2 for lp in whole.logprobs)
            assert "".join(lp.token for lp in whole.logprobs).startswith(whole.message.content or "")
            parts = [
                p
                async for p in await oc.chat(
                    model="default", messages=MESSAGES, options=GREEDY, logprobs=True, top_logprobs=2, stream=True
                )
            ]
            assert sum(len(p.logprobs or []) for p in parts) == parts[-1].eval_count
            plain = await oc.generate(model="default", prompt="Hi", options=GREEDY)
            assert plain.logprobs is None
