"""backend openai against a second genie-supervisor as the remote (builtin backend, SmolLM2, its own API key on a
loopback port), through the official openai client against the first: answers, errors, fallback, voice priority."""

from __future__ import annotations

import io
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
import structlog

from engine import Model, load_model
from genie_supervisor.app import Supervisor
from genie_supervisor.logging import configure_logging
from genie_supervisor.mqtt.entity_model import Inputs
from genie_supervisor.mqtt.entity_table import STATIC
from genie_supervisor.status import format_status
from tests.apitools import http, make_api_supervisor, oai
from tests.daemon import wait_for, write_config, write_policy
from tests.models import SMOLLM2, require
from tests.net import free_port
from tests.serving_daemon import model, threaded_daemon

pytestmark = pytest.mark.timeout(120)

KEY = "remote-key-5b1e0c9d7a"
"""The remote daemon's API key (the local one sends it; it must never show in logs or status)."""
KEY_ENV = "GENIE_TEST_REMOTE_KEY"
HI: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
__all__ = ["model"]  # the module-scoped SmolLM2 fixture the remote serves


class Remote:
    """The remote daemon on a fixed loopback port: stopped and started again by the fallback and timeout tests."""

    def __init__(self, cfg: Path, model: Model) -> None:
        self.cfg, self.model, self.port = cfg, model, free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._stack: ExitStack | None = None
        self.sup: Supervisor

    def start(self) -> None:
        """Serve (returns once the daemon is ready)."""
        self._stack = ExitStack()
        self.sup = self._stack.enter_context(
            threaded_daemon(self.cfg, port=self.port, model_loader=lambda *_a, **_k: self.model)
        )

    def stop(self) -> None:
        """Stop serving (the port refuses connections after)."""
        assert self._stack is not None
        self._stack.close()
        self._stack = None

    def client(self) -> openai.AsyncOpenAI:
        """The official client straight against the remote."""
        return openai.AsyncOpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=60)

    def admitted(self) -> int:
        """Requests the remote has admitted so far."""
        return sum(self.sup.admission.admitted.values())

    def admitted_by_class(self) -> dict[str, int]:
        """Requests the remote has admitted so far, by the class it queued them in."""
        return {cls: n for cls, n in self.sup.admission.admitted.items() if n}


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory, model: Model) -> Iterator[Remote]:
    """One remote daemon for the module: SmolLM2 on the builtin backend, guarded by `KEY`."""
    tmp = tmp_path_factory.mktemp("remote")
    extra = f"api: {{warmup: false, api_key: {KEY}}}"
    cfg = write_config(
        tmp / "remote.yaml", write_policy(tmp / "p.yaml"), model=SMOLLM2, engine="n_ctx: 512", extra=extra
    )
    r = Remote(cfg, model)
    r.start()
    yield r
    if r._stack is not None:
        r.stop()


@pytest.fixture(scope="module")
def local_model() -> Model:
    """A second SmolLM2 (the local daemon's fallback; two daemons must not share one KV cache)."""
    return load_model(require(SMOLLM2), threads=1)


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The remote's key in the environment variable the local config names."""
    monkeypatch.setenv(KEY_ENV, KEY)


def local_config(
    remote: Remote, *, fallback: bool = True, first_token_s: float = 60, probe_s: float = 0.1, forward: bool = False
) -> str:
    """The local daemon: SmolLM2 `local` (role voice) in this process, `big` (role brain) on the remote."""
    return f"""\
backend: builtin
openai: {{url: "{remote.url}", api_key_env: {KEY_ENV}, health_interval_s: {probe_s}, connect_timeout_s: 2, first_token_timeout_s: {first_token_s}, forward_priority: {str(forward).lower()}}}
models:
  local: {{path: {require(SMOLLM2)}, roles: [voice], resident: true, n_ctx: 512}}
  big: {{backend: openai, remote_model: default, roles: [brain], resident: true{", fallback_model: voice" if fallback else ""}}}
api: {{warmup: false}}
"""


@asynccontextmanager
async def local_daemon(tmp_path: Path, remote: Remote, local_model: Model, **kw: Any) -> AsyncIterator[Supervisor]:
    """The local daemon of `local_config`, running."""
    sup = make_api_supervisor(tmp_path, local_config(remote, **kw), model_loader=lambda *_a, **_k: local_model)
    async with sup:
        yield sup


def _mqtt_model_attributes(sup: Supervisor) -> dict[str, Any]:
    """The attributes the MQTT `model` sensor publishes now (the remote's identity and state)."""
    entity = next(e for e in STATIC if e.key == "model")
    assert entity.attributes is not None
    return dict(entity.attributes(Inputs(sup.store.snapshot())))


async def _chat(client: openai.AsyncOpenAI, model: str, **kw: Any) -> str:
    r = await client.chat.completions.create(model=model, messages=HI, max_tokens=12, temperature=0, **kw)
    return r.choices[0].message.content or ""


async def _streamed(client: openai.AsyncOpenAI, model: str) -> tuple[str, int]:
    text, chunks = "", 0
    async for chunk in await client.chat.completions.create(
        model=model, messages=HI, max_tokens=12, temperature=0, stream=True
    ):
        piece = "".join(c.delta.content or "" for c in chunk.choices)
        text, chunks = text + piece, chunks + bool(piece)
    return text, chunks


async def test_answers_match_the_remote_streamed_and_whole_on_every_route(
    tmp_path: Path, remote: Remote, local_model: Model, key_env: None
) -> None:
    """Chat (whole and streamed token by token), text completions, Ollama's /api/chat and llama-server's
    /completion through backend openai answer what the remote answers itself; /health names the remote."""
    with anyio.fail_after(100):
        async with local_daemon(tmp_path, remote, local_model) as sup, oai(sup) as oa, remote.client() as direct:
            want = await _chat(direct, "default")
            assert want and await _chat(oa, "brain") == want
            text, chunks = await _streamed(oa, "brain")
            assert text == want and chunks > 1  # relayed piece by piece, not as one block

            comp = await direct.completions.create(model="default", prompt="The sky is", max_tokens=8, temperature=0)
            mine = await oa.completions.create(model="brain", prompt="The sky is", max_tokens=8, temperature=0)
            assert mine.choices[0].text == comp.choices[0].text and mine.usage is not None
            assert sup.models.models["big"].usage.decode_tps > 0  # the remote's own timings reach /metrics
            assert mine.usage.completion_tokens == comp.usage.completion_tokens  # type: ignore[union-attr]

            async with http(sup) as client:
                body = {
                    "model": "brain",
                    "messages": HI,
                    "stream": False,
                    "options": {"temperature": 0, "num_predict": 12},
                }
                assert (await client.post("/api/chat", json=body)).json()["message"]["content"] == want
                llama = {"model": "brain", "prompt": "The sky is", "n_predict": 8, "temperature": 0}
                assert (await client.post("/completion", json=llama)).json()["content"] == comp.choices[0].text
                health = (await client.get("/health")).json()
                assert health["remotes"]["big"] == {
                    "backend": "openai",
                    "url": remote.url,
                    "remote_model": "default",
                    "state": "up",
                    "serving": "remote",
                    "fallback_model": "voice",
                    "problem": None,
                    "listed": False,  # the remote lists its id, not the role it is asked by
                    "switches": 0,
                    "auth": True,
                }
                status = (await client.get("/status")).json()
                big = next(m for m in status["models"] if m["id"] == "big")
                assert big["backend_identity"] == "openai/remote" and big["remote"]["state"] == "up"
            attributes = _mqtt_model_attributes(sup)
            assert attributes["remote_url"] == remote.url and attributes["remote_model"] == "default"
            assert attributes["remote_state"] == "up"


async def test_remote_errors_are_relayed_and_tools_logprobs_pass_through(
    tmp_path: Path, remote: Remote, local_model: Model, key_env: None
) -> None:
    """A request longer than the remote's context (4,096 tokens) is the remote's 400 with its message, its 503 our
    502 naming it; logprobs, a forced tool
    call and a JSON response_format reach the remote and come back in OpenAI's shapes."""
    with anyio.fail_after(100):
        async with local_daemon(tmp_path, remote, local_model) as sup, oai(sup) as oa, remote.client() as direct:
            with pytest.raises(openai.BadRequestError) as info:
                await oa.chat.completions.create(model="brain", max_tokens=5000, messages=HI)
            assert "openai remote" in str(info.value) and "context" in str(info.value)

            remote.sup.models.enabled = False  # the remote refuses with a 503 (its LLM switch is off)
            try:
                with pytest.raises(openai.APIStatusError) as status:
                    await _chat(oa, "brain")
            finally:
                remote.sup.models.enabled = True
            assert status.value.status_code == 502 and f"openai remote {remote.url} answered 503" in str(status.value)

            r = await oa.chat.completions.create(
                model="brain", messages=HI, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
            )
            lps = r.choices[0].logprobs
            assert lps is not None and lps.content and len(lps.content[0].top_logprobs) == 2
            assert "".join(t.token for t in lps.content) == r.choices[0].message.content

            weather = {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 12}},
                        "required": ["city"],
                    },
                },
            }
            r = await oa.chat.completions.create(
                model="brain",
                messages=HI,
                max_tokens=40,
                temperature=0,
                tools=[weather],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
            )
            calls = r.choices[0].message.tool_calls
            assert calls and calls[0].function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
            assert isinstance(json.loads(calls[0].function.arguments)["city"], str)

            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
            fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            ask: Any = {"messages": HI, "max_tokens": 12, "temperature": 0, "response_format": fmt}
            mine = (await oa.chat.completions.create(model="brain", **ask)).choices[0].message.content
            want = (await direct.chat.completions.create(model="default", **ask)).choices[0].message.content
            assert mine == want and mine is not None and mine.replace(" ", "").replace("\n", "").startswith('{"ok":')


async def test_a_remote_too_slow_for_its_deadline_is_a_504_naming_it(
    tmp_path: Path, remote: Remote, local_model: Model, key_env: None
) -> None:
    """A remote that sends no first token within openai.first_token_timeout_s is a 504 whose message names
    the remote and the deadline, streamed or not; the remote stays up (no fallback for a slow answer)."""
    with anyio.fail_after(100):
        async with local_daemon(tmp_path, remote, local_model, first_token_s=0.001) as sup, oai(sup) as oa:
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError) as info:
                    r = await oa.chat.completions.create(model="brain", messages=HI, max_tokens=4, stream=stream)
                    async for _ in r:  # type: ignore[union-attr]
                        pass
                assert info.value.status_code == 504 and remote.url in str(info.value)
                assert "0.001 s" in str(info.value)
            assert sup.models.models["big"].backend.identity() == "openai/remote"
        # the remote may still be taking up the requests given up on: a fresh one for the next tests' counters
        await anyio.to_thread.run_sync(remote.stop)
        await anyio.to_thread.run_sync(remote.start)


async def test_voice_goes_first_while_a_background_request_is_held_before_it_is_sent(
    tmp_path: Path, remote: Remote, local_model: Model, key_env: None
) -> None:
    """While STT holds the local gate paused, a background request for the remote model is not sent (the remote
    admits nothing for it) and a voice request passes; the background one is sent once the pause ends. With
    forward_priority the remote (a genie-supervisor) queues each in its own class."""
    with anyio.fail_after(100):
        async with local_daemon(tmp_path, remote, local_model, forward=True) as sup, http(sup) as client:
            await client.post("/v1/voice/events", json={"service": "stt", "event": "start"})
            await wait_for(sup, lambda: sup.gate.mode == "paused")
            before, done = remote.admitted_by_class(), []
            body = {"model": "brain", "messages": HI, "max_tokens": 4, "temperature": 0}

            def sent() -> dict[str, int]:
                now = remote.admitted_by_class()
                return {cls: n - before.get(cls, 0) for cls, n in now.items() if n > before.get(cls, 0)}

            async def background() -> None:
                r = await client.post("/v1/chat/completions", json=body, headers={"x-genie-priority": "background"})
                assert r.status_code == 200
                done.append("background")

            async with anyio.create_task_group() as tg:
                tg.start_soon(background)
                await wait_for(sup, lambda: sup.admission.running == 1)  # admitted here, held at the gate
                r = await client.post("/v1/chat/completions", json=body, headers={"x-genie-priority": "voice"})
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
                done.append("voice")
                assert sent() == {"voice": 1} and done == ["voice"]  # only the voice request went out
                await client.post("/v1/voice/events", json={"service": "stt", "event": "stop"})
            assert done == ["voice", "background"] and sent() == {"voice": 1, "background": 1}


async def test_client_disconnect_closes_the_remote_request(
    tmp_path: Path, remote: Remote, local_model: Model, key_env: None
) -> None:
    """A client that goes away mid-stream ends the remote's generation too (its request leaves the remote)."""
    with anyio.fail_after(100):
        async with local_daemon(tmp_path, remote, local_model) as sup, http(sup) as client:
            count = [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]
            body = {"model": "brain", "messages": count, "max_tokens": 400, "temperature": 0, "stream": True}
            usage = remote.sup.models.models[next(iter(remote.sup.models.models))].usage
            requests, tokens = usage.requests, usage.completion_tokens
            counted = threading.Event()  # set on the remote daemon's thread once its request is counted
            remove = remote.sup.store.add_listener(lambda: counted.set() if usage.requests > requests else None)
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if re.search(r'"content":"[^"]', line):
                            break  # a first token arrived: go away
                ended = await anyio.to_thread.run_sync(counted.wait, 30.0)
            finally:
                remove()
            assert ended, "the remote still runs the request 30 s after the client went away"
            assert 0 < usage.completion_tokens - tokens < 400


async def test_remote_down_falls_back_to_the_local_model_and_recovers(
    tmp_path: Path, remote: Remote, local_model: Model, key_env: None
) -> None:
    """With the remote stopped, requests for it are answered by the local fallback model (the switch logged,
    shown in /health, /metrics, `genie-supervisor status` and the MQTT model sensor, no key anywhere in the logs); once the remote answers its probe
    again, requests go back to it."""
    buf = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging("debug", "json", stream=buf)
    try:
        with anyio.fail_after(110):
            async with local_daemon(tmp_path, remote, local_model) as sup, oai(sup) as oa, http(sup) as client:
                big = sup.models.models["big"].backend
                local_answer = await _chat(oa, "voice")
                remote_answer = await _chat(oa, "brain")
                await anyio.to_thread.run_sync(remote.stop)
                try:
                    await wait_for(sup, lambda: big.identity() == "openai/fallback")  # type: ignore[attr-defined]
                    assert await _chat(oa, "brain") == local_answer
                    text, _ = await _streamed(oa, "brain")
                    assert text == local_answer
                    health = (await client.get("/health")).json()
                    assert health["remotes"]["big"]["state"] == "down" and health["remotes"]["big"]["switches"] == 1
                    assert _mqtt_model_attributes(sup)["remote_state"] == "fallback"
                    metrics = (await client.get("/metrics")).text
                    assert f'genie_remote_up{{model="big",url="{remote.url}"}} 0.0' in metrics
                    assert 'genie_remote_fallback{model="big"} 1.0' in metrics
                    assert 'genie_remote_switches_total{model="big"} 1.0' in metrics
                    status_text = (await client.get("/status")).text
                    assert KEY not in status_text and KEY not in str(health)
                    shown = format_status(json.loads(status_text), "here")
                    assert f"remote {remote.url} model default: down, answered by voice" in shown
                finally:
                    await anyio.to_thread.run_sync(remote.start)
                await wait_for(sup, lambda: big.identity() == "openai/remote")  # type: ignore[attr-defined]
                before = remote.admitted()
                assert await _chat(oa, "brain") == remote_answer and remote.admitted() == before + 1

    finally:
        structlog.reset_defaults()
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    logs = buf.getvalue()
    assert '"event": "remote_down"' in logs and '"event": "remote_up"' in logs
    assert KEY not in logs


async def test_a_request_that_finds_the_remote_gone_falls_back_itself_and_without_fallback_gets_502(
    tmp_path: Path, remote: Remote, local_model: Model, key_env: None
) -> None:
    """With no probe due, the request whose connection is refused is answered by the fallback model (and moves
    the model to it); without a fallback_model the same outage is a 502 naming the remote."""
    with anyio.fail_after(110):
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        async with (
            local_daemon(tmp_path / "a", remote, local_model, probe_s=600) as sup,
            local_daemon(tmp_path / "b", remote, local_model, fallback=False, probe_s=600) as bare,
            oai(sup) as oa,
            oai(bare) as oa_bare,
        ):
            local_answer = await _chat(oa, "voice")
            big = sup.models.models["big"].backend
            assert big.identity() == "openai/remote"
            await anyio.to_thread.run_sync(remote.stop)
            try:
                assert await _chat(oa, "brain") == local_answer
                assert big.identity() == "openai/fallback"
                with pytest.raises(openai.APIStatusError) as info:
                    await _chat(oa_bare, "brain")
                assert info.value.status_code == 502 and f"openai remote {remote.url} unreachable" in str(info.value)
            finally:
                await anyio.to_thread.run_sync(remote.start)
