"""The daemon as a real process under faults: stuck worker threads and signals, a broker killed, model
files removed or replaced, caches that cannot be written, and what tracebacks leave in the log."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
import structlog

from engine import load_model
from genie_supervisor.exit_deadline import ExitDeadline, describe, stuck_threads
from genie_supervisor.logging import FOREIGN_LOGGERS, configure_logging
from genie_supervisor.mqtt.entities import Topics
from tests.apitools import synth
from tests.broker import Mosquitto, needs_broker
from tests.daemon import client, make_supervisor, write_policy
from tests.daemon_process import DaemonProcess
from tests.models import SMOLLM2, require
from tests.test_mqtt import is_, subscriber

pytestmark = pytest.mark.timeout(90)


async def _wait_status(d: DaemonProcess, pred: Callable[[dict[str, Any]], bool], within_s: float = 30) -> None:
    """Poll /status (a process we do not control: no event to await) until `pred` holds."""
    async with httpx.AsyncClient(base_url=d.url, timeout=10) as api:
        with anyio.fail_after(within_s):
            while True:
                if pred((await api.get("/status")).json()):
                    return
                await anyio.sleep(0.05)


async def test_sigterm_exits_within_bound_while_a_worker_thread_is_stuck(tmp_path: Path) -> None:
    """SIGTERM during a prefill step that runs for many seconds in a worker thread ends the process
    within api.shutdown_timeout_s (+2 s), exit 0, with a `shutdown_forced` line naming the thread."""
    model = require(SMOLLM2)
    daemon = DaemonProcess(
        tmp_path,
        model=model,
        backend="numpy",
        n_ctx=2048,
        policy_chunk=2048,
        extra="api: {warmup: false, shutdown_timeout_s: 3}",
    )
    async with daemon as d, httpx.AsyncClient(base_url=d.url, timeout=60) as api, anyio.create_task_group() as tg:
        prompt = [1000 + i % 4000 for i in range(2000)]  # one 2000-token prefill step on NumPy: >10 s

        async def request() -> None:
            try:
                await api.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            except httpx.HTTPError:
                pass  # the connection goes with the process

        tg.start_soon(request)
        # the gate counts a prefill step just before the step's worker thread starts ("prefill"
        # alone is the state from admission on: the lock and the prompt-cache lookup come first)
        await _wait_status(d, lambda s: s["gate"]["steps_total"].get("prefill", 0) >= 1)
        rc, elapsed = await d.sigterm(within_s=3 + 2)
        forced = await d.event("shutdown_forced", within_s=1)
    assert rc == 0 and elapsed < 5, (rc, elapsed)
    assert any("AnyIO worker thread" in t for t in forced["threads"]), forced
    assert forced["bound_s"] == 3


async def test_a_daemon_that_served_constrained_output_exits_at_once_on_sigterm(tmp_path: Path) -> None:
    """The thread that computes grammar masks does not hold the exit: after a JSON-mode answer the
    daemon exits 0 on SIGTERM without a forced exit."""
    daemon = DaemonProcess(tmp_path, model=require(SMOLLM2), extra="api: {warmup: false, shutdown_timeout_s: 8}")
    async with daemon as d, httpx.AsyncClient(base_url=d.url, timeout=60) as api:
        body = {
            "messages": [{"role": "user", "content": "Give me a JSON object with a key 'on'."}],
            "max_tokens": 8,
            "response_format": {"type": "json_object"},
        }
        assert (await api.post("/v1/chat/completions", json=body)).status_code == 200
        rc, elapsed = await d.sigterm(within_s=12)
    forced = d.forced_exits()
    assert rc == 0 and not forced and elapsed < 4, (elapsed, forced)


@needs_broker
@pytest.mark.timeout(180)
async def test_a_daemon_that_used_every_api_exits_at_once_on_sigterm(tmp_path: Path) -> None:
    """After the OpenAI, Ollama and llama-server routes, a tool call, JSON mode, the prompt cache
    written and read back and MQTT, nothing the daemon started holds its exit: SIGTERM ends it
    with status 0 within a second or two and no forced exit."""
    broker = Mosquitto(tmp_path)
    await broker.start()
    extra = (
        f"mqtt: {{url: '{broker.url}'}}\n"
        f"prompt_cache: {{dir: {tmp_path / 'pc'}, min_tokens: 16}}\n"
        "api: {warmup: true, shutdown_timeout_s: 8}"
    )
    system = {"role": "system", "content": "You run the lights of a small house. Answer in one short sentence."}
    tool = {
        "type": "function",
        "function": {
            "name": "light_on",
            "description": "Turn a light on",
            "parameters": {"type": "object", "properties": {"room": {"type": "string"}}, "required": ["room"]},
        },
    }
    try:
        async with (
            DaemonProcess(tmp_path, model=require(SMOLLM2), backend="native", extra=extra) as d,
            httpx.AsyncClient(base_url=d.url, timeout=60) as api,
        ):
            await d.event("mqtt_online")
            few: dict[str, Any] = {"max_tokens": 3, "temperature": 0}
            chats = [
                {"messages": [system, {"role": "user", "content": "Hi"}], **few},
                {"messages": [system, {"role": "user", "content": "Hi again"}], "stream": True, **few},
                {
                    "messages": [{"role": "user", "content": "JSON please"}],
                    "response_format": {"type": "json_object"},
                    **few,
                },
                {
                    "messages": [{"role": "user", "content": "Kitchen light on"}],
                    "tools": [tool],
                    "tool_choice": "required",
                    **few,
                },
            ]
            for body in chats:
                assert (await api.post("/v1/chat/completions", json=body)).status_code == 200, body
            ollama = {"model": "default", "stream": False, "options": {"num_predict": 2}}
            msgs = [system, {"role": "user", "content": "Hello"}]
            calls = [
                ("/v1/completions", {"prompt": "The porch light", **few}),
                ("/api/chat", {**ollama, "messages": msgs}),
                ("/api/generate", {**ollama, "prompt": "The porch light"}),
                ("/completion", {"prompt": "The porch light", "n_predict": 2}),
                ("/tokenize", {"content": "The porch light"}),
                ("/api/show", {"model": "default"}),
            ]
            for path, body in calls:
                assert (await api.post(path, json=body)).status_code == 200, path
            for path in ("/status", "/metrics", "/health", "/v1/models", "/api/tags", "/api/ps"):
                assert (await api.get(path)).status_code == 200, path
            rc, elapsed = await d.sigterm(within_s=12)
    finally:
        await broker.stop()
    forced = d.forced_exits()
    assert rc == 0 and not forced and elapsed < 4, (elapsed, forced)


async def test_sigterm_mid_generation_ends_streams_with_a_finish_reason(tmp_path: Path) -> None:
    """SIGTERM while the official openai client streams one answer and waits for another: the stream
    ends with a finish_reason chunk and [DONE], the waiting request gets a 503 JSON, exit 0 within bound."""
    model = require(SMOLLM2)
    async with (
        DaemonProcess(tmp_path, model=model, n_ctx=1024) as d,
        openai.AsyncOpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0, timeout=90) as client,
    ):
        messages: Any = [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]
        args: Any = dict(model="default", messages=messages, max_tokens=900, extra_body={"ignore_eos": True})
        got_chunks = anyio.Event()
        events: list[Any] = []
        other: list[Any] = []

        async def streaming() -> None:
            async with client.chat.completions.with_streaming_response.create(stream=True, **args) as raw:
                async for line in raw.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    if len(events) == 5:
                        got_chunks.set()

        async def waiting() -> None:
            try:
                other.append(await client.chat.completions.create(**args))
            except openai.APIStatusError as exc:
                other.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(streaming)
            await got_chunks.wait()
            tg.start_soon(waiting)
            await _wait_status(d, lambda s: s["engine"]["stats"]["requests_in_flight"] == 2)
            rc, elapsed = await d.sigterm(within_s=5 + 2)
    assert rc == 0 and elapsed < 5, (rc, elapsed)
    assert events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "cancelled", events[-2]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    (answer,) = other
    assert isinstance(answer, openai.APIStatusError) and answer.status_code == 503, answer
    assert "shutting down" in answer.message
    assert (await d.event("supervisor_stopped", within_s=1))["reason"] == "SIGTERM"
    assert not any(e.get("event") == "shutdown_forced" for e in d.log.items)


async def test_sighup_reloads_a_changed_policy_without_watching(tmp_path: Path) -> None:
    """With policy.watch false, an edited policy file takes effect on SIGHUP: logged and shown by /status."""
    async with DaemonProcess(tmp_path, model=None) as d, httpx.AsyncClient(base_url=d.url, timeout=10) as api:
        before = (await api.get("/status")).json()["policy"]
        assert before["name"] == "faults" and before["generation"] == 1
        write_policy(d.policy, "edited", cap=7)
        mark = d.mark()
        d.signal(signal.SIGHUP)
        loaded = await d.event("policy_loaded", lambda e: e["name"] == "edited", start=mark)
        assert loaded["previous"] == "faults"
        after = (await api.get("/status")).json()
        assert after["policy"]["name"] == "edited" and after["policy"]["error"] is None
        assert after["policy"]["generation"] == 2
        assert (await api.get("/health")).json()["policy"] == "edited"


async def test_model_file_removed_or_replaced_while_loaded(tmp_path: Path) -> None:
    """A loaded model keeps serving when its file is removed or replaced by rename; a reload after the
    removal is a 503 naming the missing file (the daemon stays up), and the renamed-in file loads next."""
    path = tmp_path / "model.gguf"
    os.link(require(SMOLLM2), path)  # a second name for the cached file: removing it leaves the cache alone
    chat: Any = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    async with DaemonProcess(tmp_path, model=path) as d, httpx.AsyncClient(base_url=d.url, timeout=60) as api:
        path.unlink()
        assert (await api.post("/v1/chat/completions", json=chat)).status_code == 200  # still mapped
        assert (await api.post("/unload", json={})).json()["unloaded"] == ["model"]
        gone = await api.post("/v1/chat/completions", json=chat)
        assert gone.status_code == 503, gone.text
        assert str(path) in gone.json()["error"]["message"], gone.json()
        assert (await d.event("model_load_failed"))["model"] == "model"

        os.replace(synth(tmp_path, "tiny"), path)  # the fix: a new file renamed into place
        assert (await api.post("/v1/chat/completions", json=chat)).status_code == 200
        assert (await api.get("/status")).json()["engine"]["model"] == "tiny"
        spare = tmp_path / "spare.gguf"
        os.link(SMOLLM2, spare)
        os.replace(spare, path)  # replaced by rename while "tiny" is loaded: "tiny" keeps serving
        assert (await api.post("/v1/chat/completions", json=chat)).status_code == 200
        assert (await api.get("/status")).json()["engine"]["model"] == "tiny"
        assert (await api.get("/health")).json()["status"] == "ok"


@needs_broker
async def test_broker_killed_mid_generation(tmp_path: Path) -> None:
    """Mosquitto SIGKILLed during a streamed generation: the generation completes, the disconnect is
    logged, and once the broker is back on its port the daemon republishes discovery and `online`."""
    broker = Mosquitto(tmp_path)
    await broker.start()
    topics = Topics.make("genie", "homeassistant", "genie")
    extra = f"mqtt: {{url: '{broker.url}', reconnect_max_s: 1}}"
    try:
        async with (
            DaemonProcess(tmp_path, model=require(SMOLLM2), extra=extra) as d,
            httpx.AsyncClient(base_url=d.url, timeout=60) as api,
        ):
            await d.event("mqtt_online", lambda e: e["connections"] == 1)
            body = {
                "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}],
                "max_tokens": 24,
                "temperature": 0,
                "stream": True,
            }
            events: list[Any] = []
            async with api.stream("POST", "/v1/chat/completions", json=body) as resp:
                lines = resp.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if '"content":"' in line and '"content":""' not in line:
                            break  # the first token: the generation runs
                assert broker.proc is not None
                mark = d.mark()
                broker.proc.kill()
                await broker.proc.wait()
                await d.event("mqtt_connection_lost", start=mark)
                after = len(events)
                async for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
            assert events[-1] == "[DONE]" and len(events) > after + 2
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
            assert (await d.event("generation_done", start=mark))["completion_tokens"] == 24

            await broker.start()  # the same port, no retained state: everything seen now is republished
            async with subscriber(broker.port, "homeassistant/#", "genie/#") as (rec, _):
                await d.event("mqtt_online", lambda e: e["connections"] == 2, start=mark)
                await rec.wait_for(topics.availability, is_("online"), within_s=10)
                device = json.loads(await rec.wait_for(topics.device_config, lambda p: bool(p), within_s=10))
                assert device["cmps"], device
            status = (await api.get("/status")).json()["mqtt"]
            assert status["connected"] is True and status["connections"] == 2, status
    finally:
        await broker.stop()


async def test_unwritable_kernel_cache_is_a_warning_and_the_daemon_serves(tmp_path: Path) -> None:
    """A kernel cache folder that cannot be created (a file where the folder should be) is logged as a
    warning; the native kernels are built for the process anyway and the daemon answers requests."""
    blocker = tmp_path / "cache"
    blocker.write_text("a file where ~/.cache should be a folder\n")
    daemon = DaemonProcess(tmp_path, model=require(SMOLLM2), env={"XDG_CACHE_HOME": str(blocker)})
    async with daemon as d, httpx.AsyncClient(base_url=d.url, timeout=60) as api:
        warning = next(e for e in d.log.items if "cannot be written" in str(e.get("event")))
        assert warning["level"] == "warning" and str(blocker) in warning["event"]
        assert (await d.event("model_loaded"))["backend"] == "native"
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert (await api.post("/v1/chat/completions", json=chat)).status_code == 200
    assert blocker.read_text().startswith("a file")


class _ExplodingTemplate:
    """A loaded model whose chat template raises (a bug's stand-in) while its frames hold the prompt."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        rendered = "".join(m["content"] for m in messages)  # a local that holds the prompt text
        raise RuntimeError(f"template engine exploded after {len(rendered)} characters")


async def test_a_crashing_request_logs_its_traceback_without_the_prompt(tmp_path: Path) -> None:
    """A request whose handler raises gets a 500 and a JSON traceback in the log, with no local
    variables: the prompt text (and whatever else the frames held) is not in the captured log."""
    secret = "PROMPT-TEXT-7f3a9c the user's private words"
    root = logging.getLogger()
    saved_root = (list(root.handlers), root.level)
    saved_foreign = {
        n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
        for n in FOREIGN_LOGGERS
    }
    saved_structlog = structlog.get_config()
    captured = io.StringIO()
    configure_logging("info", "json", captured)
    try:

        def loader(path: str, **kwargs: Any) -> Any:
            return _ExplodingTemplate(load_model(path, **kwargs))

        sup = make_supervisor(
            tmp_path, policy=write_policy(tmp_path / "p.yaml"), model=synth(tmp_path, "tiny"), model_loader=loader
        )
        with anyio.fail_after(30):
            async with sup, client(sup) as http:
                r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": secret}]})
    finally:
        structlog.configure(**saved_structlog)
        root.handlers[:] = saved_root[0]
        root.setLevel(saved_root[1])
        for name, (handlers, level, propagate) in saved_foreign.items():
            foreign = logging.getLogger(name)
            foreign.handlers[:], foreign.level, foreign.propagate = handlers, level, propagate
    assert r.status_code == 500 and secret not in r.text
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    (failed,) = [e for e in lines if e["event"] == "request_failed"]
    frames = [f for exc in failed["exception"] for f in exc["frames"]]
    assert any(f["name"] == "encode_chat" for f in frames), failed  # the traceback is there ...
    assert not any("locals" in f for f in frames)  # ... without its locals
    assert "PROMPT-TEXT-7f3a9c" not in captured.getvalue()


def test_exit_deadline_waits_for_threads_then_forces_the_exit() -> None:
    """ExitDeadline.finish returns once worker threads end, and forces the exit (with the status) when
    one is still running at the deadline; the forced exit names the thread and happens once."""
    exits: list[int] = []
    quick = threading.Thread(target=time.sleep, args=(0.05,), name="quick worker")
    quick.start()
    calm = ExitDeadline(exit_fn=exits.append)
    calm.finish(0, seconds=5)
    calm.disarm()
    assert exits == [] and not quick.is_alive()

    release = threading.Event()
    stuck = threading.Thread(target=release.wait, args=(30,), name="stuck worker")
    stuck.start()
    try:
        assert [t.name for t in stuck_threads()] == ["stuck worker"]
        assert describe(stuck).startswith("stuck worker in threading.")
        deadline = ExitDeadline(exit_fn=exits.append)
        t0 = time.monotonic()
        deadline.finish(3, seconds=0.2)
        assert exits == [3] and 0.15 < time.monotonic() - t0 < 5
        deadline.force(4)
        assert exits == [3]
    finally:
        release.set()
        stuck.join()
