"""The llama_cpp backend against a real process speaking llama-server's API (tests/fake_llama_server.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest

from engine import SamplingParams
from tests.apitools import FAKE_LLAMA, LLAMA_CPP_CONFIG, fake_llama_server, http, make_api_supervisor, oai, synth
from tests.daemon import wait_for
from tests.fake_llama_server import REPLY

pytestmark = pytest.mark.timeout(90)

HI: list[Any] = [{"role": "user", "content": "hi"}]


def _wrapper(tmp_path: Path) -> Path:
    """An executable that starts the fake server with whatever llama-server arguments it gets."""
    script = tmp_path / "llama-server"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_LLAMA} "$@"\n', encoding="utf-8")
    script.chmod(0o755)
    return script


def _started_config(tmp_path: Path) -> str:
    """A config that starts the fake llama-server (SIGSTOPped while the gate is paused) for model brain."""
    return f"""\
backend: llama_cpp
llama_cpp: {{binary: {_wrapper(tmp_path)}, pause_with_signals: true, startup_timeout_s: 60}}
models:
  brain: {{path: {synth(tmp_path, "brain")}, roles: [default], resident: true, n_ctx: 128}}
api: {{warmup: false}}
"""


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


async def _until(predicate: Any, timeout: float = 5.0) -> None:  # noqa: ASYNC109
    """Another process's state has no event to wait on: poll it, bounded."""
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await anyio.sleep(0.01)
    raise AssertionError(f"not within {timeout} s")


async def test_started_llama_server_serves_openai_client_and_is_sigstopped_on_pause(tmp_path: Path) -> None:
    """backend llama_cpp starts llama-server, serves chat/completions/completion through it, SIGSTOPs it while STT runs."""
    sup = make_api_supervisor(tmp_path, _started_config(tmp_path))
    with anyio.fail_after(80):
        async with sup, oai(sup) as oa, http(sup) as client:
            health = (await client.get("/health")).json()
            assert health["backend_kind"] == "llama_cpp" and health["backend_identity"] == "llama_cpp/started"
            listed = (await client.get("/v1/models")).json()["data"]
            assert listed[0]["backend"] == "llama_cpp" and listed[0]["state"] == "ready"

            whole = await oa.chat.completions.create(model="brain", messages=HI, max_tokens=16)
            assert whole.choices[0].message.content == "".join(REPLY)
            assert whole.choices[0].finish_reason == "stop" and whole.usage is not None
            assert whole.usage.completion_tokens == len(REPLY)
            text, usage = "", None
            async for chunk in await oa.chat.completions.create(
                model="default", messages=HI, max_tokens=16, stream=True, stream_options={"include_usage": True}
            ):
                text += "".join(c.delta.content or "" for c in chunk.choices)
                usage = chunk.usage or usage
            assert text == "".join(REPLY) and usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens

            comp = await oa.completions.create(model="brain", prompt="one two", max_tokens=3)
            assert comp.choices[0].text == "".join(REPLY[:3]) and comp.choices[0].finish_reason == "length"
            assert comp.usage is not None and comp.usage.prompt_tokens == 2
            r = (await client.post("/completion", json={"prompt": "one two", "n_predict": 3})).json()
            assert r["content"] == "".join(REPLY[:3]) and r["tokens_predicted"] == 3 and r["stop_type"] == "limit"

            with pytest.raises(openai.BadRequestError) as info:
                await oa.chat.completions.create(
                    model="brain", max_tokens=8, messages=[{"role": "user", "content": "w " * 200}]
                )
            assert "context size" in str(info.value)

            proc = sup.models.models["brain"].backend.process  # type: ignore[attr-defined]
            await client.post("/v1/voice/events", json={"service": "stt", "event": "start"})
            await wait_for(sup, lambda: sup.gate.mode == "paused")
            await _until(lambda: _proc_state(proc.pid) == "T")
            await client.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
            await wait_for(sup, lambda: sup.gate.mode == "open")
            await _until(lambda: _proc_state(proc.pid) != "T")
            again = await oa.chat.completions.create(model="brain", messages=HI, max_tokens=2)
            assert again.choices[0].message.content == "".join(REPLY[:2])
    assert proc.returncode is not None  # stopped with the daemon


async def test_voice_request_passes_an_stt_pause_on_llama_server_while_background_waits(tmp_path: Path) -> None:
    """While STT holds the gate paused, a voice-priority request is answered through llama-server (the
    SIGSTOPped process runs again for it and is stopped again after), and a background request waits
    until the pause ends."""
    sup = make_api_supervisor(tmp_path, _started_config(tmp_path))
    with anyio.fail_after(80):
        async with sup, http(sup) as client:
            proc = sup.models.models["brain"].backend.process  # type: ignore[attr-defined]
            await client.post("/v1/voice/events", json={"service": "stt", "event": "start"})
            await wait_for(sup, lambda: sup.gate.mode == "paused")
            await _until(lambda: _proc_state(proc.pid) == "T")
            done: list[str] = []

            async def background() -> None:
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "brain", "messages": HI, "max_tokens": 4},
                    headers={"x-genie-priority": "background"},
                )
                assert r.status_code == 200
                done.append("background")

            async with anyio.create_task_group() as tg:
                tg.start_soon(background)
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "brain", "messages": HI, "max_tokens": 4},
                    headers={"x-genie-priority": "voice"},
                )
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "".join(REPLY[:4])
                done.append("voice")
                await _until(lambda: _proc_state(proc.pid) == "T")  # stopped again once the voice reply ended
                assert done == ["voice"] and sup.gate.mode == "paused"
                await client.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
            assert done == ["voice", "background"]
            await _until(lambda: _proc_state(proc.pid) != "T")


async def test_voice_stream_releases_the_stopped_llama_server_once_read_or_closed_unread(tmp_path: Path) -> None:
    """During an STT pause each voice stream keeps the SIGSTOPped llama-server running until it ends, and
    releases it once: one read to the end and then closed does not release the other's hold, and one
    closed unread (aclose) lets the process be stopped again."""
    sup = make_api_supervisor(tmp_path, _started_config(tmp_path))
    with anyio.fail_after(80):
        async with sup, http(sup) as client:
            backend = sup.models.models["brain"].backend
            proc = backend.process  # type: ignore[attr-defined]
            await client.post("/v1/voice/events", json={"service": "stt", "event": "start"})
            await wait_for(sup, lambda: sup.gate.mode == "paused")
            await _until(lambda: _proc_state(proc.pid) == "T")

            params = SamplingParams(temperature=0, max_tokens=2)
            read = await backend.generate(HI, params, "voice")
            unread = await backend.generate(HI, params, "voice")
            await _until(lambda: _proc_state(proc.pid) != "T")  # running for the voice replies
            assert "".join([p.text async for p in read]) == "".join(REPLY[:2])
            await read.aclose()  # read to the end and closed: one release, not two
            assert _proc_state(proc.pid) != "T" and sup.gate.mode == "paused"
            await unread.aclose()  # closed unread: its hold ends too
            await _until(lambda: _proc_state(proc.pid) == "T")
            await client.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
            await _until(lambda: _proc_state(proc.pid) != "T")


async def test_int8_kv_starts_llama_server_with_q8_0_caches(tmp_path: Path) -> None:
    """kv_dtype int8 starts llama-server with q8_0 K and V caches and plans their smaller KV."""
    argv = tmp_path / "argv"
    script = tmp_path / "llama-server"
    script.write_text(f'#!/bin/sh\necho "$@" > {argv}\nexec {sys.executable} {FAKE_LLAMA} "$@"\n', encoding="utf-8")
    script.chmod(0o755)
    body = f"""\
backend: llama_cpp
llama_cpp: {{binary: {script}, startup_timeout_s: 60}}
models:
  brain: {{path: {synth(tmp_path, "brain")}, resident: true, n_ctx: 128, kv_dtype: int8}}
  other: {{path: {synth(tmp_path, "other")}, n_ctx: 128}}
api: {{warmup: false}}
"""
    sup = make_api_supervisor(tmp_path, body)
    with anyio.fail_after(60):
        async with sup, oai(sup) as oa:
            r = await oa.chat.completions.create(model="brain", messages=HI, max_tokens=2)
            assert r.choices[0].message.content == "".join(REPLY[:2])
            args = argv.read_text().split()
            assert args[args.index("--cache-type-k") + 1] == "q8_0"
            assert args[args.index("--cache-type-v") + 1] == "q8_0"
            brain = sup.models.models["brain"].backend
            other = sup.models.models["other"].backend
            assert other.cache_args() == []  # type: ignore[attr-defined]
            kv8, kv16 = (await brain.plan()).kv, (await other.plan()).kv  # type: ignore[attr-defined]
            assert kv8 == kv16 * 34 // 64


async def test_missing_llama_server_falls_back_to_builtin(tmp_path: Path) -> None:
    """With the llama-server binary missing, `fallback: builtin` serves the model and /health says so."""
    body = f"""\
backend: llama_cpp
fallback: builtin
llama_cpp: {{binary: {tmp_path / "no-such-llama-server"}}}
models:
  brain: {{path: {synth(tmp_path, "brain")}, resident: true}}
api: {{warmup: false}}
"""
    sup = make_api_supervisor(tmp_path, body)
    with anyio.fail_after(60):
        async with sup, oai(sup) as oa, http(sup) as client:
            health = (await client.get("/health")).json()
            assert health["fell_back"] is True and health["backend_kind"] == "builtin"
            r = await oa.chat.completions.create(model="brain", messages=HI, max_tokens=2, temperature=0)
            assert r.usage is not None and r.usage.completion_tokens == 2


async def test_attached_llama_server_by_url(tmp_path: Path) -> None:
    """`llama_cpp.url` attaches to a running llama-server: requests go there, unloading leaves it running."""
    async with fake_llama_server() as (port, proc):
        with anyio.fail_after(60):
            sup = make_api_supervisor(tmp_path, LLAMA_CPP_CONFIG.format(port=port))
            async with sup, oai(sup) as oa, http(sup) as client:
                r = await oa.chat.completions.create(messages=HI, model="remote", max_tokens=4)
                assert r.choices[0].message.content == "".join(REPLY[:4])
                assert (await client.post("/unload", json={})).json()["unloaded"] == ["remote"]
                assert proc.returncode is None
                r = await oa.chat.completions.create(messages=HI, model="default", max_tokens=1)
                assert r.choices[0].message.content == REPLY[0]


def test_llama_server_command_is_logged_without_its_secrets() -> None:
    """The logged llama-server command hides the value of --api-key (both spellings) and keeps every other argument."""
    from genie_supervisor.llm.llama_cpp import redacted

    cmd = ["llama-server", "-m", "m.gguf", "--api-key", "s3cret", "--port", "8081", "--api-key-file=/k", "-c", "4096"]
    shown = redacted(cmd)
    assert "s3cret" not in shown and "--api-key-file=/k" not in shown
    assert shown == [
        "llama-server",
        "-m",
        "m.gguf",
        "--api-key",
        "***",
        "--port",
        "8081",
        "--api-key-file=***",
        "-c",
        "4096",
    ]
