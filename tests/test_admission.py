"""Admission under load, client disconnects, and bad input (tiny synthetic models; never a 500)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest

from tests.apitools import http, make_api_supervisor, oai, synth

pytestmark = pytest.mark.timeout(120)

HI: list[Any] = [{"role": "user", "content": "hi"}]


def _one_model(tmp_path: Path, api: str = "{max_running: 1, max_queue: 16, warmup: false}") -> str:
    return f"models:\n  tiny: {{path: {synth(tmp_path, 'tiny')}, resident: true}}\napi: {api}\n"


async def test_64_streaming_clients_with_queue_of_16_get_answers_or_429(tmp_path: Path) -> None:
    """64 concurrent streams, 1 slot, queue 16: each gets a complete answer or a 429 with Retry-After; no slot leaks."""
    sup = make_api_supervisor(tmp_path, _one_model(tmp_path))
    outcomes: list[str] = []
    with anyio.fail_after(100):
        async with sup, oai(sup) as oa, http(sup) as client:

            async def one(i: int) -> None:
                try:
                    stream = await oa.chat.completions.create(
                        model="tiny", messages=HI, max_tokens=4, temperature=0, stream=True
                    )
                    finish, text = None, ""
                    async for chunk in stream:
                        for c in chunk.choices:
                            text += c.delta.content or ""
                            finish = c.finish_reason or finish
                    assert finish == "length" and text
                    outcomes.append("ok")
                except openai.RateLimitError as exc:
                    assert int(exc.response.headers["retry-after"]) >= 1
                    assert exc.body["code"] == "queue_full"  # type: ignore[index]
                    outcomes.append("429")

            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(one, i)
            assert len(outcomes) == 64 and set(outcomes) <= {"ok", "429"}
            assert outcomes.count("ok") >= 17 and outcomes.count("429") >= 1
            print(f"\n64 clients: {outcomes.count('ok')} answered, {outcomes.count('429')} got 429")
            status = (await client.get("/status")).json()
            assert status["admission"]["running"] == 0 and status["admission"]["queued"] == 0
            assert status["models"][0]["in_flight"] == 0 and status["engine"]["stats"]["requests_in_flight"] == 0
            assert sup.gate.metrics()["generations"] == 0
            metrics = (await client.get("/metrics")).text
            assert 'genie_rejections_total{priority="background",reason="queue_full"}' in metrics


async def test_disconnects_leave_the_queue_and_stop_generation_at_the_parked_step(tmp_path: Path) -> None:
    """A streaming client that goes away frees its slot while decode is paused; a queued one leaves the queue."""
    sup = make_api_supervisor(tmp_path, _one_model(tmp_path))
    with anyio.fail_after(60):
        async with sup, http(sup) as client:
            model = sup.models.models["tiny"]
            first = anyio.Event()

            async def stream_then_leave() -> None:
                async with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json={"messages": HI, "max_tokens": 200, "temperature": 0, "stream": True},
                ) as s:
                    async for line in s.aiter_lines():
                        if '"content":"' in line and '"content":""' not in line:
                            first.set()
                            await anyio.sleep_forever()  # the test cancels us: the connection closes

            async def queued() -> None:
                await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})

            async with anyio.create_task_group() as tg:
                tg.start_soon(stream_then_leave)
                await first.wait()
                sup.gate.pause({"test"})  # the generation parks at its next step
                assert await sup.gate.wait_parked(10)
                tg.start_soon(queued)
                with anyio.fail_after(10):
                    while sup.admission.queued != 1:
                        await sup.store.wait_changed(sup.store.version)
                tg.cancel_scope.cancel()  # both clients go away
            with anyio.fail_after(10):
                while sup.admission.running or sup.admission.queued or model.in_flight:
                    await sup.store.wait_changed(sup.store.version)
            assert sup.gate.mode == "paused"  # freed while parked: it did not run to its end
            assert model.usage.completion_tokens < 200
            assert sup.admission.rejected[("background", "disconnected")] == 1
            host = model.backend.host  # type: ignore[attr-defined]
            assert host.in_flight == 0 and sup.gate.metrics()["generations"] == 0
            sup.gate.open()
            r = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def test_bad_input_gets_4xx_in_openai_shape_never_500(tmp_path: Path) -> None:
    """Malformed JSON, wrong types, n>1, oversized bodies, too-long prompts, unknown models and classes are 4xx."""
    sup = make_api_supervisor(
        tmp_path, _one_model(tmp_path, "{max_body_bytes: 4096, warmup: false, unknown_model: error}")
    )
    with anyio.fail_after(60):
        async with sup, http(sup) as client:

            async def post(path: str, status: int, param: str | None = None, **kw: Any) -> dict[str, Any]:
                r = await client.post(path, **kw)
                assert r.status_code == status, (path, kw, r.status_code, r.text)
                err = r.json()["error"]
                assert err["message"] and err["type"] == "invalid_request_error" and "param" in err
                if param is not None:
                    assert err["param"] == param, err
                return err

            chat = "/v1/chat/completions"
            await post(chat, 400, content=b"{not json")
            await post(chat, 400, content=b"[1, 2]")
            await post(chat, 400, "messages", json={"messages": "hi"})
            await post(chat, 400, "messages", json={})
            await post(chat, 400, "max_tokens", json={"messages": HI, "max_tokens": "many"})
            await post(chat, 400, "temperature", json={"messages": HI, "temperature": "hot"})
            await post(chat, 400, "stream", json={"messages": HI, "stream": "yes"})
            await post(chat, 400, "messages.0.role", json={"messages": [{"role": "robot", "content": "x"}]})
            await post(chat, 400, "n", json={"messages": HI, "n": 2})
            await post(chat, 400, json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
            await post("/v1/completions", 400, "prompt", json={"prompt": 5})
            await post("/completion", 400, "n_predict", json={"prompt": "x", "n_predict": "ten"})
            err = await post(chat, 413, content=b'{"messages": "' + b"x" * 5000 + b'"}')
            assert "4096" in err["message"]

            async def chunked() -> Any:
                yield b'{"messages": "'
                for _ in range(10):
                    yield b"x" * 1000
                yield b'"}'

            await post(chat, 413, content=chunked())
            long = " ".join(["word"] * 400)
            err = await post(chat, 400, json={"messages": [{"role": "user", "content": long}], "max_tokens": 4})
            assert "allows 256" in err["message"] and err["code"] == "context_length_exceeded"
            err = await post("/v1/completions", 400, json={"prompt": long, "max_tokens": 4})
            assert "allows 256" in err["message"]
            err = await post(chat, 404, json={"messages": HI, "model": "gpt-4"})
            assert err["code"] == "model_not_found" and "tiny" in err["message"]
            err = await post(chat, 400, json={"messages": HI}, headers={"X-Genie-Priority": "urgent"})
            assert "voice" in err["message"]
            r = await client.get(chat)
            assert r.status_code == 405 and "error" in r.json()
            ok = await client.post(
                chat,
                json={"messages": HI, "max_tokens": 1, "frequency_penalty": 0.5, "logit_bias": {}, "user": "u"},
                headers={"X-Genie-Priority": "voice"},
            )
            assert ok.status_code == 200  # unknown fields are ignored
            assert sup.admission.admitted["voice"] == 1
            with pytest.raises(httpx.HTTPStatusError):
                (await client.post("/unload", content=b"nope")).raise_for_status()


async def test_voice_turn_preempts_a_background_generation(tmp_path: Path) -> None:
    """With the only slot held by a background stream, a voice request is admitted and finishes first."""
    sup = make_api_supervisor(tmp_path, _one_model(tmp_path))
    order: list[str] = []
    with anyio.fail_after(100):
        async with sup, oai(sup) as oa:
            first_token = anyio.Event()

            async def background() -> None:
                stream = await oa.chat.completions.create(
                    model="tiny",
                    messages=HI,
                    max_tokens=200,
                    temperature=0,
                    stream=True,
                    extra_headers={"X-Genie-Priority": "background"},
                    extra_body={"ignore_eos": True},
                )
                n = 0
                async for _chunk in stream:
                    n += 1
                    first_token.set()
                order.append(f"background:{n > 1}")

            async def voice() -> None:
                await first_token.wait()
                r = await oa.chat.completions.create(
                    model="tiny", messages=HI, max_tokens=3, temperature=0, extra_headers={"X-Genie-Priority": "voice"}
                )
                assert r.choices[0].message.content is not None
                order.append("voice")

            async with anyio.create_task_group() as tg:
                tg.start_soon(background)
                tg.start_soon(voice)
    assert order == ["voice", "background:True"]
