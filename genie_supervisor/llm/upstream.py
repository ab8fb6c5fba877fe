"""What the backends that forward requests to an HTTP server share (``llama_cpp``, ``openai``).

    body = {**sampling_fields(sampling), "messages": [openai_message(m) for m in prompt], ...}
    response = await client.send(request, stream=True)     # non-200: error_message(await response.aread())
    stream = SomeRelay(response, gate, priority, who="llama-server")
    async for piece in stream: ...      # one Piece per SSE event with text; gated between pieces

`RelayStream` reads a server-sent-event answer: it stops at ``[DONE]``, turns an ``error`` event
or a broken connection into an `UpstreamError` (502) and a missed deadline into one with 504,
waits at the decode gate before each piece (a voice pause holds a background answer between two
chunks), and closes the upstream connection when it ends, is cut off or closed unread. Subclasses
say what one event adds (`_take`) and what comes after the last one (`_end`). `ChatDeltas` folds
OpenAI chat-completion chunks: content, finish reason, usage, tool calls and log-probabilities.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import httpx

from engine import SamplingParams
from engine.tool_calls import HERMES, ToolSyntax, hermes_call_text

from ..errors import UpstreamError
from .serving import Piece, TokenLogprob


def is_chat(prompt: Any) -> bool:
    """Whether `prompt` is chat messages (else text or token ids)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)


def sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    """The sampling fields both llama-server and OpenAI-compatible servers take, with ``stream``."""
    out: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "stream": True,
    }
    if sampling.seed is not None:
        out["seed"] = sampling.seed
    if sampling.stop:
        out["stop"] = list(sampling.stop)
    return out


def openai_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chat message as an OpenAI-compatible server takes it: an assistant's tool-call arguments as JSON text again."""
    out = dict(message)
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
            if isinstance(c.get("function", {}).get("arguments"), dict)
            else c
            for c in out["tool_calls"]
        ]
    return out


def error_message(raw: bytes) -> str:
    """The message of an upstream error body (OpenAI's ``{"error": {"message": ...}}``, llama-server's, or text)."""
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj)
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")[:500]


ERROR_BODY_MAX = 65536
"""Bytes of an upstream error answer read at most (its message is in the first few hundred)."""


async def error_answer(response: httpx.Response, who: str) -> bytes:
    """The body of a non-200 upstream answer (at most `ERROR_BODY_MAX` bytes), the response closed either
    way; a body that breaks off or times out is an `UpstreamError` (502) naming `who`, not a bare
    httpx error."""
    try:
        raw = b""
        async for chunk in response.aiter_bytes():
            raw += chunk
            if len(raw) >= ERROR_BODY_MAX:
                break
        return raw[:ERROR_BODY_MAX]
    except httpx.HTTPError as exc:
        raise UpstreamError(
            502, f"{who} answered {response.status_code}, then its body broke off: {type(exc).__name__}: {exc}"
        ) from None
    finally:
        with anyio.CancelScope(shield=True):
            await response.aclose()


def usage_of(obj: Mapping[str, Any]) -> tuple[int, int] | None:
    """An OpenAI chunk's ``usage`` as (prompt tokens, completion tokens); None when it carries none."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def _spelled(entry: Mapping[str, Any]) -> bytes:
    raw = entry.get("bytes")
    if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return str(entry.get("token") or "").encode()


def chat_logprobs(choice: Mapping[str, Any]) -> tuple[TokenLogprob, ...]:
    """A chat chunk choice's ``logprobs.content`` as TokenLogprobs (token ids unknown upstream: -1)."""
    content = (choice.get("logprobs") or {}).get("content") or []
    return tuple(
        TokenLogprob(
            -1,
            _spelled(e),
            float(e.get("logprob") or 0.0),
            tuple((-1, _spelled(t), float(t.get("logprob") or 0.0)) for t in e.get("top_logprobs") or []),
        )
        for e in content
        if isinstance(e, Mapping)
    )


class ChatDeltas:
    """OpenAI chat-completion chunks folded into pieces, counts, tool calls and the finish reason."""

    def __init__(self) -> None:
        self.finish_reason: str | None = None
        """The last ``finish_reason`` seen."""
        self.prompt_tokens = 0
        """``usage.prompt_tokens`` (known at the end)."""
        self.completion_tokens = 0
        """``usage.completion_tokens`` at the end; content chunks until then."""
        self.calls: dict[int, dict[str, str]] = {}
        """Tool calls by index: name and the arguments' text as streamed."""

    def take(self, obj: Mapping[str, Any]) -> Piece | None:
        """The piece one chunk adds (None: no text or log-probabilities in it)."""
        usage = usage_of(obj)
        if usage is not None:
            self.prompt_tokens, self.completion_tokens = usage
        text = ""
        probs: tuple[TokenLogprob, ...] = ()
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or {}
            text += delta.get("content") or ""
            probs += chat_logprobs(choice)
            for call in delta.get("tool_calls") or []:
                mine = self.calls.setdefault(int(call.get("index") or 0), {"name": "", "arguments": ""})
                fn = call.get("function") or {}
                mine["name"] += fn.get("name") or ""
                mine["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        if not text and not probs:
            return None
        if usage is None:
            self.completion_tokens += max(1, len(probs))
        return Piece(text, (), probs)

    def calls_text(self) -> str:
        """The tool calls streamed as structured deltas, written as Hermes ``<tool_call>`` blocks
        (the API parses them back with `HERMES`); "" when there were none."""
        out = []
        for _i, call in sorted(self.calls.items()):
            try:
                args: Any = json.loads(call["arguments"]) if call["arguments"].strip() else {}
            except ValueError:
                args = call["arguments"]
            out.append(hermes_call_text(call["name"], args))
        return "".join(out)


class RelayStream:
    """A streamed upstream answer (SSE) as pieces with counts; subclasses read its events."""

    who = "upstream"
    """How errors name the server (``llama-server``, ``openai remote URL``)."""

    def __init__(
        self,
        response: httpx.Response,
        gate: Any,
        priority: str | None,
        *,
        who: str,
        first_s: float | None = None,
        total_s: float | None = None,
        started: float | None = None,
    ) -> None:
        self._response, self._gate, self._priority, self.who = response, gate, priority, who
        self._first_s, self._total_s = first_s, total_s  # deadlines of the first piece and of the whole answer
        self._t0 = time.monotonic() if started is None else started
        self._closed = False
        self.finish_reason: str | None = None
        """``stop``, ``length`` or ``cancelled`` once finished."""
        self.prompt_tokens = 0
        """Tokens in the prompt (the server's count, known at the end)."""
        self.completion_tokens = 0
        """Tokens generated (the server's count at the end; pieces until then)."""
        self.tool_syntax: ToolSyntax | None = None
        """How tool calls come back in the text (None: no tools)."""
        self.parallel_tool_calls = True
        """Whether the answer may carry several calls."""
        self._timings: dict[str, float] = {}

    def _take(self, obj: Mapping[str, Any]) -> Piece | None:
        raise NotImplementedError

    def _error(self, err: Any) -> Exception:
        """What an ``error`` event raises (an `UpstreamError`, 502, with the server's message)."""
        return UpstreamError(502, f"{self.who}: {err.get('message', err) if isinstance(err, dict) else err}")

    def _end(self) -> Piece | None:
        """What follows the last event (tool calls gathered from the deltas); None: nothing."""
        return None

    def _deadline(self, got_piece: bool) -> tuple[float, str]:
        """Seconds left to wait for the next event, and the setting that bounds it."""
        now = time.monotonic()
        left, key = float("inf"), ""
        if self._total_s is not None:
            left, key = self._t0 + self._total_s - now, f"total {self._total_s:g} s"
        if not got_piece and self._first_s is not None and self._t0 + self._first_s - now < left:
            left, key = self._t0 + self._first_s - now, f"first token {self._first_s:g} s"
        return max(0.0, left), key

    async def __aiter__(self) -> AsyncIterator[Piece]:
        lines = self._response.aiter_lines()
        got = False
        try:
            while True:
                left, key = self._deadline(got)
                try:
                    with anyio.fail_after(left):
                        line = await lines.__anext__()
                except StopAsyncIteration:
                    break
                except (TimeoutError, httpx.TimeoutException):
                    raise UpstreamError(504, f"{self.who} did not answer in time ({key or 'read timeout'})") from None
                except httpx.HTTPError as exc:
                    raise UpstreamError(502, f"{self.who}: the answer broke off: {type(exc).__name__}: {exc}") from None
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    raise self._error(obj["error"])
                timings = obj.get("timings")  # llama-server's and genie-supervisor's own (ms, tokens/s)
                if isinstance(timings, dict):
                    self._timings = {k: v for k, v in timings.items() if isinstance(v, (int, float))}
                piece = self._take(obj)
                if piece is not None:
                    got = True
                    await self._gate.wait("decode", self._priority)
                    yield piece
            tail = self._end()
            if tail is not None:
                yield tail
        finally:
            if self.finish_reason is None:
                self.finish_reason = "cancelled"
            await self.aclose()

    async def aclose(self) -> None:
        """Stop reading (the server notices the closed connection and stops generating)."""
        await self._response.aclose()
        if not self._closed:
            self._closed = True
            self._released()

    def _released(self) -> None:
        """Once per stream, whether it was read to the end, cut off or closed unread."""

    def timings(self) -> dict[str, float]:
        """The server's own timings (ms), where it sent them."""
        return dict(self._timings)


__all__ = [
    "HERMES",
    "ChatDeltas",
    "RelayStream",
    "chat_logprobs",
    "error_answer",
    "error_message",
    "is_chat",
    "openai_message",
    "sampling_fields",
    "usage_of",
]
