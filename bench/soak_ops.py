"""The soak's operations: each one HTTP request or one short control sequence, returning an `OpResult`.

LLM requests (`chat`, `chat_stream`, `completion`, `completion_stream`, `disconnect`) run
concurrently; control operations (policy reload and select, LLM switch bursts, swap, unload) hold
one lock so they never overlap each other; voice hints run freely.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.soak_stack import NODE, POLICY_INVALID, POLICY_VARIANTS, Daemon

SMOL, GEMMA = "smollm2", "gemma3"
PROMPTS = (
    "Turn on the kitchen lights.",
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three colours.",
    "Say hello in Spanish.",
    "What day comes after Monday?",
    "Give me a short tip for sleeping well.",
    "Count from one to five.",
)
LLM_OPS = ("chat", "chat_stream", "completion", "completion_stream", "disconnect")
CONTROL_OPS = ("policy_reload", "policy_select", "llm_toggle", "swap", "unload")


@dataclass
class OpResult:
    """What one operation did."""

    i: int
    """Position in the schedule (-1 for warm-up)."""
    op: str
    """Operation name."""
    t0: float
    """Start (monotonic s)."""
    t1: float = 0.0
    """End (monotonic s)."""
    status: str = "ok"
    """HTTP status code as text, `ok` for non-HTTP success, or the failure (`timeout`, `exc:Name`, `stayed_off` ...)."""
    ok: bool = True
    """The operation did what it should."""
    excused: bool = False
    """A failure the soak provoked itself (a 503 while its own LLM-off burst ran)."""
    tokens: int | None = None
    """Completion tokens (usage)."""
    server_tps: float | None = None
    """Decode speed from the response's timings (predicted_per_second)."""
    client_tps: float | None = None
    """Completion tokens / wall time of the request, as the client saw it."""
    detail: str = ""
    """Short explanation of a failure."""

    def fail(self, status: str, detail: str = "") -> OpResult:
        self.status, self.ok, self.detail = status, False, detail[:300]
        return self


@dataclass
class Ctx:
    """Shared by every operation of one soak."""

    http: httpx.AsyncClient
    daemon: Daemon
    mqtt: Any
    """A connected paho client (loop running in its own thread)."""
    rng: random.Random
    control: asyncio.Lock = field(default_factory=asyncio.Lock)
    off_windows: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) monotonic times of the soak's own LLM-off bursts; end is inf while one runs."""
    policy_name: str = "soak-a"
    """The policy that should be in force."""
    reloads: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    """Events worth reporting: reloads by trigger, rejections seen, toggles, recoveries."""

    def bump(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def topic(self, path: str) -> str:
        return f"genie/{NODE}/{path}"

    def publish(self, path: str, payload: str) -> None:
        self.mqtt.publish(self.topic(path), payload, qos=1)

    async def status(self) -> dict[str, Any]:
        r = await self.http.get("/status", timeout=10)
        r.raise_for_status()
        return dict(r.json())

    async def wait_status(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 15) -> dict[str, Any] | None:  # noqa: ASYNC109
        """Poll /status until `pred` holds (the last status) or `timeout` passes (None)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = await self.status()
            if pred(st):
                return st
            await asyncio.sleep(0.05)
        return None


# -- LLM requests -------------------------------------------------------------------------------
def _body(ctx: Ctx, op: str, model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    prompt = ctx.rng.choice(PROMPTS)
    if op.startswith("completion"):
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
        path = "/v1/completions"
    else:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        path = "/v1/chat/completions"
    return path, body


async def llm_request(ctx: Ctx, res: OpResult, model: str = SMOL) -> OpResult:
    """A chat or text completion, streamed or not; `disconnect` closes its stream after a few chunks."""
    op = res.op
    max_tokens = 32 if op == "disconnect" else ctx.rng.randint(8, 32)
    path, body = _body(ctx, "chat" if op == "disconnect" else op, model, max_tokens)
    stream = op.endswith("_stream") or op == "disconnect"
    if not stream:
        r = await ctx.http.post(path, json=body)
        res.status = str(r.status_code)
        if r.status_code != 200:
            return res.fail(res.status, r.text)
        data = r.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        if not isinstance(text, str) or choice.get("finish_reason") not in ("stop", "length"):
            return res.fail("bad_body", json.dumps(choice)[:300])
        res.tokens = int(data["usage"]["completion_tokens"])
        res.server_tps = float((data.get("timings") or {}).get("predicted_per_second") or 0) or None
        res.client_tps = res.tokens / max(time.monotonic() - res.t0, 1e-6)
        return res
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    chunks, done, finish = 0, False, None
    async with ctx.http.stream("POST", path, json=body) as r:
        res.status = str(r.status_code)
        if r.status_code != 200:
            await r.aread()
            return res.fail(res.status, r.text)
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data_s = line[5:].strip()
            if data_s == "[DONE]":
                done = True
                break
            chunks += 1
            obj = json.loads(data_s)
            for c in obj.get("choices") or ():
                finish = c.get("finish_reason") or finish
            if obj.get("usage"):
                res.tokens = int(obj["usage"]["completion_tokens"])
            if op == "disconnect" and chunks >= 3:
                return res  # leaving the block closes the connection mid-stream
    if op == "disconnect":
        res.detail = "stream ended before the disconnect"
        return res
    if not done or finish not in ("stop", "length"):
        return res.fail("bad_stream", f"done={done} finish={finish} chunks={chunks}")
    return res


# -- voice hints --------------------------------------------------------------------------------
async def voice_http(ctx: Ctx, res: OpResult) -> OpResult:
    """POST /v1/voice/events start, a short pause, stop (same session): STT or TTS."""
    service = ctx.rng.choice(("stt", "stt", "tts"))
    session = f"soak-{res.i}"
    for event in ("start", "stop"):
        r = await ctx.http.post("/v1/voice/events", json={"service": service, "event": event, "session": session})
        res.status = str(r.status_code)
        if r.status_code != 200:
            return res.fail(res.status, r.text)
        if event == "start":
            await asyncio.sleep(ctx.rng.uniform(0.05, 0.4))
    return res


async def voice_mqtt(ctx: Ctx, res: OpResult) -> OpResult:
    """The same start/stop pair over MQTT `genie/<node>/voice/events`."""
    service = ctx.rng.choice(("stt", "tts"))
    session = f"soak-mqtt-{res.i}"
    ctx.publish("voice/events", json.dumps({"service": service, "event": "start", "session": session}))
    await asyncio.sleep(ctx.rng.uniform(0.05, 0.4))
    ctx.publish("voice/events", json.dumps({"service": service, "event": "stop", "session": session}))
    return res


# -- control ------------------------------------------------------------------------------------
def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


async def _reload_to(ctx: Ctx, text: str, trigger: str, *, valid: bool, name: str) -> bool:
    before = await ctx.status()
    gen = before["policy"]["generation"]
    _write_atomic(ctx.daemon.files.policy, text)
    if trigger == "sighup":
        ctx.daemon.sighup()
    elif trigger == "mqtt":
        ctx.publish("policy/reload", "PRESS")
    ctx.bump(f"policy_reload_{trigger}")
    if valid:
        got = await ctx.wait_status(
            lambda s: s["policy"]["generation"] > gen and not s["policy"]["error"] and s["policy"]["name"] == name
        )
    else:
        got = await ctx.wait_status(
            lambda s: bool(s["policy"]["error"]) and s["policy"]["name"] == before["policy"]["name"]
        )
    return got is not None


async def policy_reload(ctx: Ctx, res: OpResult) -> OpResult:
    """Rewrite the policy file with the other valid variant (the 1st, 6th, 11th ... time an invalid one first, which
    must be rejected with the old policy kept); reloaded by the file watcher, SIGHUP or MQTT in turn."""
    k = ctx.reloads
    ctx.reloads += 1
    trigger = ("watch", "sighup", "mqtt")[k % 3]
    if k % 5 == 0:
        if not await _reload_to(ctx, POLICY_INVALID, trigger, valid=False, name=ctx.policy_name):
            return res.fail("invalid_not_rejected", f"trigger {trigger}: no policy error within 15 s")
        ctx.bump("policy_rejected")
    text = POLICY_VARIANTS[(k + 1) % 2]
    name = "soak-a" if text == POLICY_VARIANTS[0] else "soak-b"
    if not await _reload_to(ctx, text, trigger, valid=True, name=name):
        return res.fail("not_reloaded", f"trigger {trigger}: {name} not in force within 15 s")
    ctx.policy_name = name
    return res


async def policy_select(ctx: Ctx, res: OpResult) -> OpResult:
    """MQTT `policy/set` to soak-alt and back to soak; each confirmed in /status."""

    def in_force(name: str) -> Callable[[dict[str, Any]], bool]:
        return lambda s: bool(s["policy"]["name"] == name and not s["policy"]["error"])

    for option, name in (("soak-alt", "soak-alt"), ("soak", ctx.policy_name)):
        ctx.publish("policy/set", option)
        if await ctx.wait_status(in_force(name)) is None:
            return res.fail("not_selected", f"policy {option} not in force within 15 s")
    return res


async def llm_toggle(ctx: Ctx, res: OpResult, toggles: int = 20) -> OpResult:
    """A burst of MQTT `llm/enabled/set` OFF/ON ending in ON; the LLM must end enabled (stable 1 s)."""
    window = [time.monotonic(), float("inf")]
    ctx.off_windows.append((window[0], window[1]))
    idx = len(ctx.off_windows) - 1
    try:
        for n in range(toggles):
            ctx.publish("llm/enabled/set", "OFF" if n % 2 == 0 else "ON")
        ctx.bump("llm_toggles", toggles)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = await ctx.wait_status(
                lambda s: bool(s["engine"].get("enabled")), timeout=max(deadline - time.monotonic(), 0.1)
            )
            if st is None:
                break
            await asyncio.sleep(1.0)
            if (await ctx.status())["engine"].get("enabled"):
                return res
        res.fail("stayed_off", f"the LLM was not ON within 30 s of a burst of {toggles} toggles ending ON")
        ctx.publish("llm/enabled/set", "ON")  # put it back so the soak goes on
        ctx.bump("llm_recovered_by_extra_on")
        await ctx.wait_status(lambda s: bool(s["engine"].get("enabled")), timeout=30)
        return res
    finally:
        ctx.off_windows[idx] = (window[0], time.monotonic() + 1.0)


async def swap(ctx: Ctx, res: OpResult) -> OpResult:
    """Ask for the other model of the swap group by name (SmolLM2 comes back with the next request)."""
    r = await ctx.http.post(
        "/v1/chat/completions",
        json={"model": GEMMA, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
    )
    res.status = str(r.status_code)
    if r.status_code != 200:
        return res.fail(res.status, r.text)
    ctx.bump("swaps")
    return res


async def unload(ctx: Ctx, res: OpResult) -> OpResult:
    """POST /unload (every model; running requests drain first)."""
    r = await ctx.http.post("/unload", json={})
    res.status = str(r.status_code)
    if r.status_code != 200:
        return res.fail(res.status, r.text)
    ctx.bump("unloads")
    return res


OPS: dict[str, Callable[[Ctx, OpResult], Awaitable[OpResult]]] = {
    **{name: llm_request for name in LLM_OPS},
    "voice_http": voice_http,
    "voice_mqtt": voice_mqtt,
    "policy_reload": policy_reload,
    "policy_select": policy_select,
    "llm_toggle": llm_toggle,
    "swap": swap,
    "unload": unload,
}


async def run_op(ctx: Ctx, i: int, op: str) -> OpResult:
    """Run one operation; exceptions and timeouts become failed results, 503s in an LLM-off burst are excused."""
    res = OpResult(i, op, time.monotonic())
    try:
        if op in CONTROL_OPS:
            async with ctx.control:
                await OPS[op](ctx, res)
        else:
            await OPS[op](ctx, res)
    except httpx.TimeoutException as exc:
        res.fail("timeout", repr(exc))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        res.fail(f"exc:{type(exc).__name__}", repr(exc))
    res.t1 = time.monotonic()
    if not res.ok and res.status == "503":
        res.excused = any(a <= res.t1 and res.t0 <= b for a, b in ctx.off_windows)
    return res
