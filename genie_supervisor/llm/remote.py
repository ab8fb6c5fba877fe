"""The openai backend: a model served by a remote OpenAI-compatible server (vLLM, llama-server,
Ollama's ``/v1``, another genie-supervisor), reached at ``openai.url``.

Gated at admission as an attached llama-server: a request waits while the decode gate is paused
for its class before it is sent (a ``voice`` request passes the pauses held for the voice path),
and relaying waits at the gate between chunks. Chat goes to ``POST <url>/chat/completions``, text
to ``POST <url>/completions``, both streamed; tools, ``response_format`` (a JSON schema or JSON
object) and log-probabilities are passed on. A remote 4xx answer is our 4xx with its message; a
remote 5xx or a broken connection is a 502 and a missed deadline a 504, each naming the remote.

Health: ``GET <url>/models`` at load and every ``openai.health_interval_s``. With
``fallback_model``, a remote that cannot be reached (probe or request) hands its requests to that
local model until a probe passes again; each switch is logged (``remote_down``, ``remote_up``) and
shown in /health, /status, /metrics, `genie-supervisor status` and the MQTT model sensor.
"""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack
from typing import Any

import anyio
import anyio.to_thread
import httpx
import structlog

from engine import SamplingParams

from ..config import ModelEntry
from ..errors import BackendUnavailable, BadRequest, UpstreamError
from ..urls import redact_url
from .admission import PRIORITY_HEADER
from .serving import NO_EXTRAS, BackendContext, Piece, Plan, RequestExtras, TextStream
from .upstream import (
    HERMES,
    ChatDeltas,
    RelayStream,
    error_answer,
    error_message,
    is_chat,
    openai_message,
    sampling_fields,
    usage_of,
)

log = structlog.get_logger(__name__)


class Unreachable(Exception):
    """The remote could not be reached (connection refused or timed out)."""


class RemoteStream(RelayStream):
    """A remote's streamed answer: chat chunks (content, tool calls, log-probabilities) or text completions."""

    def __init__(self, response: httpx.Response, chat: bool, extras: RequestExtras, **kw: Any) -> None:
        super().__init__(response, **kw)
        self._chat = ChatDeltas() if chat else None
        if chat and extras.tools_active:
            self.tool_syntax = HERMES  # the remote's structured calls come back as Hermes blocks (`_end`)
            self.parallel_tool_calls = extras.parallel_tool_calls

    def _take(self, obj: Mapping[str, Any]) -> Piece | None:
        if self._chat is not None:
            piece = self._chat.take(obj)
            self.finish_reason = self._chat.finish_reason or self.finish_reason
            self.prompt_tokens, self.completion_tokens = self._chat.prompt_tokens, self._chat.completion_tokens
            return piece
        usage = usage_of(obj)
        if usage is not None:
            self.prompt_tokens, self.completion_tokens = usage
        text = ""
        for choice in obj.get("choices") or []:
            text += str(choice.get("text") or "")
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        if text and usage is None:
            self.completion_tokens += 1
        return Piece(text) if text else None

    def _end(self) -> Piece | None:
        calls = self._chat.calls_text() if self._chat is not None and self.tool_syntax is not None else ""
        if calls and self.finish_reason == "tool_calls":
            self.finish_reason = "stop"  # the API sets tool_calls itself once it has parsed them
        return Piece(calls) if calls else None


class FallbackStream:
    """A local model's stream while the remote is down: closing it ends its lease on that model."""

    def __init__(self, stream: TextStream, stack: AsyncExitStack) -> None:
        self._stream = stream
        self._stack = stack

    def __getattr__(self, name: str) -> Any:  # finish_reason, counts, tool_syntax: the local stream's
        return getattr(self._stream, name)

    def __aiter__(self) -> Any:
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        """Close the local stream, then give its model's lease back."""
        try:
            await self._stream.aclose()
        finally:
            await self._stack.aclose()

    def timings(self) -> dict[str, float]:
        """The local stream's timings."""
        return self._stream.timings()


class OpenAIBackend:
    """One model served by a remote OpenAI-compatible server."""

    kind = "openai"

    def __init__(self, model_id: str, entry: ModelEntry, ctx: BackendContext) -> None:
        self.model_id = model_id
        """The model's id here."""
        self.cfg = ctx.cfg.openai
        """The openai section."""
        self.url = (self.cfg.url or "").rstrip("/")
        """The remote's base URL (it holds no credentials: the config refuses them)."""
        self.remote_model = entry.remote_model or model_id
        """The model name sent to the remote."""
        self.fallback_model = entry.fallback_model
        """Id or role of the local model answering while the remote is unreachable (None: none)."""
        self.n_ctx = entry.n_ctx or ctx.cfg.engine.n_ctx
        """Context length shown for it (the remote decides its own)."""
        self.gate = ctx.gate
        """The decode gate (admission and relaying wait on it)."""
        self.reachable: bool | None = None
        """Whether the last probe or request reached the remote (None: not tried yet)."""
        self.problem: str | None = None
        """Why the remote was last found unreachable."""
        self.listed: list[str] = []
        """Model ids the remote's /models listed at the last probe."""
        self.switches = 0
        """Times requests moved to the fallback."""
        self._ctx = ctx
        self._client: httpx.AsyncClient | None = None
        self._probing: anyio.CancelScope | None = None
        self._probed: anyio.Event | None = None

    @property
    def who(self) -> str:
        """How errors and logs name the remote."""
        return f"openai remote {redact_url(self.url)}"

    @property
    def serving(self) -> str:
        """``remote``, or ``fallback`` while the fallback model answers for it."""
        return "fallback" if self.fallback_model and self.reachable is False else "remote"

    def identity(self) -> str:
        """``openai/remote``, or ``openai/fallback`` while the local fallback answers."""
        return f"openai/{self.serving}"

    async def plan(self) -> Plan:
        """Nothing held here: the remote's memory is not ours."""
        return Plan(0, 0, 0, self.n_ctx)

    # -- lifecycle --------------------------------------------------------------------------
    async def load(self) -> None:
        """Open the connection pool and probe the remote once (down is a state, not a load failure: the
        local models start either way, and the probe goes on every ``health_interval_s``)."""
        cfg = self.cfg
        verify: Any = cfg.verify_tls
        if cfg.ca_file is not None:
            verify = await anyio.to_thread.run_sync(lambda: ssl.create_default_context(cafile=cfg.ca_file))
        key = cfg.key()
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            headers={"Authorization": f"Bearer {key}"} if key else None,
            verify=verify,
        )
        await self._probe()  # a remote that is down does not stop the start: the probe goes on

    async def unload(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109 - same signature as the others
        """Close the connections (the remote keeps running); a probe still running is stopped first."""
        client, self._client = self._client, None
        if self._probing is not None and self._probed is not None:
            self._probing.cancel()
            await self._probed.wait()
        if client is not None:
            await client.aclose()

    async def shutdown(self, timeout: float = 2.0) -> None:  # noqa: ASYNC109
        """Process exit: close the connections."""
        await self.unload(timeout)

    async def check(self) -> str | None:
        """Probe the remote and switch to or from the fallback; the model stays ready either way
        (without a fallback its requests get 502 while the remote is down), so always None."""
        await self._probe()
        return None

    async def _probe(self) -> str | None:
        """GET <url>/models: None when it answers 200, else why not (the state is updated); None
        without a word when the backend is unloaded meanwhile."""
        client = self._client
        if client is None:
            return None
        scope, self._probed = anyio.CancelScope(), anyio.Event()
        self._probing, problem = scope, None
        try:
            with scope:
                problem = await self._ask(client)
        finally:
            self._probing = None
            self._probed.set()
        if scope.cancelled_caught:
            return None
        self._reached(problem is None, problem)
        return problem

    async def _ask(self, client: httpx.AsyncClient) -> str | None:
        try:
            with anyio.fail_after(self.cfg.connect_timeout_s + 5.0):
                r = await client.get(f"{self.url}/models")
        except (httpx.HTTPError, TimeoutError) as exc:
            return f"{self.who} unreachable: {type(exc).__name__}: {exc}"
        if r.status_code != 200:
            return f"{self.who} /models answered {r.status_code}: {error_message(r.content)[:200]}"
        try:
            data = r.json().get("data")
        except (ValueError, AttributeError):  # not JSON, or not an object
            data = None
        self.listed = [str(m.get("id")) for m in data if isinstance(m, dict)][:64] if isinstance(data, list) else []
        return None

    def _reached(self, ok: bool, problem: str | None) -> None:
        """Record a probe's or request's outcome; a change is logged and announced."""
        before = self.serving
        was, self.reachable = self.reachable, ok
        if not ok:
            self.problem = problem
        if was == ok:
            return
        fields = {"model": self.model_id, "url": redact_url(self.url), "remote_model": self.remote_model}
        if ok:
            log.info("remote_up", **fields, serving=self.serving)
        else:
            log.warning("remote_down", **fields, fallback=self.fallback_model, problem=problem)
        if self.serving != before and self.serving == "fallback":
            self.switches += 1
        self._ctx.changed()

    # -- requests ---------------------------------------------------------------------------
    async def generate(
        self, prompt: Any, sampling: SamplingParams, priority: str | None, extras: RequestExtras = NO_EXTRAS
    ) -> TextStream:
        """Wait for the gate, then send the request to the remote (or its fallback while it is down)."""
        body = self._body(prompt, sampling, extras)
        if self._client is None:
            raise BackendUnavailable(f"model {self.model_id!r} is not loaded")
        await self.gate.wait("prefill", priority)
        if self.serving == "fallback":
            return await self._local(prompt, sampling, priority, extras)
        try:
            return await self._send(body, is_chat(prompt), priority, extras)
        except Unreachable as exc:
            self._reached(False, str(exc))
            if self.serving == "fallback":
                return await self._local(prompt, sampling, priority, extras)
            raise UpstreamError(502, str(exc)) from None

    async def _local(self, prompt: Any, sampling: SamplingParams, priority: str | None, extras: RequestExtras) -> Any:
        """The fallback model's stream, holding its lease until the stream is closed."""
        lease_of = self._ctx.lease
        assert lease_of is not None and self.fallback_model is not None
        stack = AsyncExitStack()
        try:
            lease = await stack.enter_async_context(lease_of(self.fallback_model))
            stream = await lease.backend.generate(prompt, sampling, priority, extras)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        return FallbackStream(stream, stack)

    def _body(self, prompt: Any, sampling: SamplingParams, extras: RequestExtras) -> dict[str, Any]:
        """The remote request's body (BadRequest for what an OpenAI-compatible server does not take)."""
        body: dict[str, Any] = {
            **sampling_fields(sampling),
            "model": self.remote_model,
            "max_tokens": sampling.max_tokens,
            "stream_options": {"include_usage": True},
        }
        if sampling.logit_bias:
            body["logit_bias"] = {str(t): max(-100.0, min(100.0, b)) for t, b in sampling.logit_bias}
        if extras.bias_text:
            raise BadRequest("logit_bias by text is not supported by the openai backend (use token ids)", "logit_bias")
        grammar = extras.grammar
        if grammar is not None and grammar.kind not in ("json_schema", "json_object"):
            field = extras.grammar_param or "grammar"
            raise BadRequest(f"{field} is not supported by the openai backend (response_format is)", field)
        if not is_chat(prompt):
            if extras.tools or grammar is not None:
                field = "tools" if extras.tools else extras.grammar_param or "response_format"
                raise BadRequest(f"{field} needs chat messages on the openai backend", field)
            body["prompt"] = prompt
            if sampling.logprobs is not None:
                body["logprobs"] = sampling.logprobs
            return body
        body["messages"] = [openai_message(m) for m in prompt]
        if sampling.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = sampling.logprobs
        if extras.tools:
            body["tools"] = list(extras.tools)
            body["tool_choice"] = extras.tool_choice
            body["parallel_tool_calls"] = extras.parallel_tool_calls
        if grammar is not None and grammar.kind == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif grammar is not None:
            schema = json.loads(grammar.source)
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
        return body

    async def _send(
        self, body: dict[str, Any], chat: bool, priority: str | None, extras: RequestExtras
    ) -> RemoteStream:
        assert self._client is not None
        url = f"{self.url}/chat/completions" if chat else f"{self.url}/completions"
        headers = {PRIORITY_HEADER: priority} if self.cfg.forward_priority and priority else None
        request = self._client.build_request("POST", url, json=body, headers=headers)
        t0 = time.monotonic()
        try:
            with anyio.fail_after(self.cfg.first_token_timeout_s):
                try:
                    response = await self._client.send(request, stream=True)
                except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                    # a pooled connection the remote had closed (it restarted, or its keep-alive ran out):
                    # once more on a fresh one
                    response = await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise Unreachable(f"{self.who} unreachable: {type(exc).__name__}: {exc}") from None
        except (TimeoutError, httpx.TimeoutException):
            raise UpstreamError(
                504,
                f"{self.who} did not answer within {self.cfg.first_token_timeout_s:g} s (openai.first_token_timeout_s)",
            ) from None
        except httpx.HTTPError as exc:
            raise UpstreamError(502, f"{self.who}: {type(exc).__name__}: {exc}") from None
        self._reached(True, None)
        if response.status_code != 200:
            raw = await error_answer(response, self.who)
            if 400 <= response.status_code < 500:  # the request's fault: the client hears it as it is
                raise UpstreamError(response.status_code, f"{self.who}: {error_message(raw)}")
            raise UpstreamError(502, f"{self.who} answered {response.status_code}: {error_message(raw)}")
        return RemoteStream(
            response,
            chat,
            extras,
            gate=self.gate,
            priority=priority,
            who=self.who,
            first_s=self.cfg.first_token_timeout_s,
            total_s=self.cfg.request_timeout_s,
            started=t0,
        )

    def describe(self) -> dict[str, Any]:
        """The remote's identity and state (never its key)."""
        return {"remote": self.remote_info()}

    def remote_info(self) -> dict[str, Any]:
        """Backend name, URL, remote model, reachability and who answers now."""
        return {
            "backend": self.kind,
            "url": redact_url(self.url),
            "remote_model": self.remote_model,
            "state": {True: "up", False: "down", None: "unknown"}[self.reachable],
            "serving": self.serving,
            "fallback_model": self.fallback_model,
            "problem": self.problem if self.reachable is False else None,
            "listed": self.remote_model in self.listed if self.listed else None,
            "switches": self.switches,
            "auth": self.cfg.key() is not None,
        }
