"""Model roles and swap groups under a memory budget (tiny synthetic models, the openai client)."""

from __future__ import annotations

from pathlib import Path

import anyio
import openai
import pytest

from tests.apitools import http, make_api_supervisor, oai, sse_data, synth
from tests.daemon import wait_for

pytestmark = pytest.mark.timeout(90)


def _config(tmp_path: Path) -> str:
    voice, a, b, huge = (
        synth(tmp_path, "voice"),
        synth(tmp_path, "brain-a", "mid", 1),
        synth(tmp_path, "brain-b", "mid", 2),
        synth(tmp_path, "huge", "big"),
    )
    return f"""\
models:
  voice: {{path: {voice}, roles: [fast], resident: true}}
  brain-a: {{path: {a}, roles: [brain], group: brains}}
  brain-b: {{path: {b}, roles: [coder], group: brains}}
  huge: {{path: {huge}}}
api: {{max_running: 4, warmup: false}}
"""


async def test_swap_group_under_budget_keeps_resident_and_drains_in_flight(tmp_path: Path) -> None:
    """Alternating roles of one swap group swap after draining; the resident stays; states are right mid-swap."""
    # budget 4 MiB: voice (0.9) + one brain (2.4) fit, two brains (4.8) do not
    sup = make_api_supervisor(tmp_path, _config(tmp_path), budget=4)
    with anyio.fail_after(80):
        async with sup, http(sup) as client, oai(sup) as oa:
            models = sup.models.models
            assert models["voice"].state == "ready" and models["brain-a"].state == "unloaded"

            async def ask(model: str) -> str:
                r = await oa.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
                )
                assert r.model in models and r.usage is not None and r.usage.completion_tokens == 2
                return r.model

            assert await ask("brain") == "brain-a"
            assert models["brain-a"].state == "ready" and models["brain-b"].state == "unloaded"

            # hold a brain-a stream in flight (decode paused by an STT hint) while coder asks for a swap
            got_first, chunks = anyio.Event(), []

            async def long_stream() -> None:
                async with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={
                        "model": "brain",
                        "messages": [{"role": "user", "content": "tell"}],
                        "max_tokens": 6,
                        "temperature": 0,
                        "stream": True,
                    },
                ) as s:
                    async for line in s.aiter_lines():
                        chunks.append(line)
                        if line.startswith("data: ") and '"content"' in line:
                            got_first.set()

            coder_answer: list[str] = []

            async def coder() -> None:
                coder_answer.append(await ask("coder"))

            async with anyio.create_task_group() as tg:
                await (await client.post("/v1/voice/events", json={"service": "stt", "event": "start"})).aread()
                await wait_for(sup, lambda: sup.gate.mode == "paused")
                tg.start_soon(long_stream)
                await wait_for(sup, lambda: models["brain-a"].in_flight == 1)
                tg.start_soon(coder)
                await wait_for(sup, lambda: models["brain-b"].state == "loading" and models["brain-a"].draining)
                listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
                assert listed["brain-b"]["state"] == "loading" and listed["brain-a"]["state"] == "ready"
                assert listed["voice"]["state"] == "ready" and listed["brain-a"]["in_flight"] == 1
                await client.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
                assert await ask("fast") == "voice"  # the resident answers throughout
            events = sse_data(chunks)
            assert events[-1] == "[DONE]"
            finish = [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
            assert finish == ["length"]  # the in-flight request ran to its end
            assert sum(1 for e in events[:-1] for c in e["choices"] if c["delta"].get("content") is not None) >= 2
            assert coder_answer == ["brain-b"]
            assert models["brain-a"].state == "unloaded" and models["brain-b"].state == "ready"

            for role, mid in (("brain", "brain-a"), ("coder", "brain-b"), ("brain", "brain-a")):
                assert await ask(role) == mid
                assert sum(m.state == "ready" for m in (models["brain-a"], models["brain-b"])) == 1
            assert models["voice"].state == "ready" and sup.models.unloads["voice"] == 0
            assert models["brain-a"].evictions + models["brain-b"].evictions == 4

            with pytest.raises(openai.APIStatusError) as info:
                await ask("huge")
            assert info.value.status_code == 503
            message = info.value.body["message"]  # type: ignore[index]
            assert "'huge' needs 13.5 MiB" in message and "n_ctx 256, f16 KV, prefill chunk 16" in message
            assert "budget (policy memory.llm_budget_mb) is 4.0 MiB" in message
            status = (await client.get("/status")).json()
            assert status["admission"]["running"] == 0 and all(m["in_flight"] == 0 for m in status["models"])
            metrics = (await client.get("/metrics")).text
            assert 'genie_model_evictions_total{model="brain-a"}' in metrics


async def test_unload_route_drains_and_model_reloads_on_demand(tmp_path: Path) -> None:
    """POST /unload drops a model (404 for unknown ones) and the next request reloads it; a disabled LLM answers 503."""
    sup = make_api_supervisor(tmp_path, _config(tmp_path), budget=4)
    with anyio.fail_after(60):
        async with sup, http(sup) as client:
            r = await client.post("/unload", json={"model": "voice"})
            assert r.status_code == 200 and r.json()["unloaded"] == ["voice"]
            assert sup.models.models["voice"].state == "unloaded"
            running = (await client.get("/running")).json()["running"]
            assert running == []
            assert (await client.post("/unload", json={"model": "nope"})).status_code == 404
            r = await client.post("/completion", json={"prompt": "hi", "n_predict": 2, "model": "fast"})
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
            assert [m["id"] for m in (await client.get("/running")).json()["running"]] == ["voice"]

            await sup.models.set_enabled(False)  # what the MQTT switch calls
            r = await client.post("/completion", json={"prompt": "hi", "n_predict": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "llm_disabled"
            assert sup.models.models["voice"].state == "unloaded" and sup.engine.state == "disabled"
            await sup.models.set_enabled(True)
            r = await client.post("/completion", json={"prompt": "hi", "n_predict": 2})
            assert r.status_code == 200 and sup.models.models["voice"].state == "ready"


async def test_first_reply_banner_and_status_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After start a warm-up times the first reply of each resident model; `genie-supervisor status` prints the state."""
    import argparse

    import anyio.to_thread

    from genie_supervisor.status import cmd_status

    body = f"models:\n  voice: {{path: {synth(tmp_path, 'voice')}, roles: [fast], resident: true}}\napi: {{warmup: true}}\n"
    sup = make_api_supervisor(tmp_path, body)
    with anyio.fail_after(60):
        async with sup:
            await wait_for(sup, lambda: "voice" in sup.models.first_reply_ms)
            assert (sup.models.first_reply_ms["voice"] or 0) > 0
            assert sup.http is not None
            rc = await anyio.to_thread.run_sync(cmd_status, argparse.Namespace(url=f"http://127.0.0.1:{sup.http.port}"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "backend: builtin/numpy (configured builtin, fallback none)" in out
    assert "voice" in out and "ready" in out and "gate: open" in out and "first reply: voice" in out
