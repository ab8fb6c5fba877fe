"""OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.tool_calls import ToolCall
from engine.tool_stream import CallDelta, arguments_text

from ..llm.admission import request_priority
from ..llm.serving import Piece
from .deps import get_deps
from .generation import GenerationResponse, Job, Result, new_id, now_s
from .schemas import ChatRequest, CompletionRequest, parse_body

router = APIRouter()

FINGERPRINT = "genie-supervisor"


def _usage(r: Result) -> dict[str, Any]:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": int(r.timings.get("cache_n", 0))},
    }


def _spelled(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(pieces: list[Piece]) -> dict[str, Any]:
    """OpenAI's ``choices[].logprobs`` of a chat answer: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = [
        {
            "token": _spelled(lp.piece),
            "logprob": lp.logprob,
            "bytes": list(lp.piece),
            "top_logprobs": [{"token": _spelled(b), "logprob": v, "bytes": list(b)} for _i, b, v in lp.top],
        }
        for p in pieces
        for lp in p.logprobs
    ]
    return {"content": content, "refusal": None}


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """One call as OpenAI writes it: id, type function, the function's name and its arguments as JSON text."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments_text(call)}}


def _finish(r: Result) -> str:
    return "tool_calls" if r.tool_calls else r.finish_reason


class ChatFormat:
    """``chat.completion`` and ``chat.completion.chunk`` objects."""

    def __init__(self, include_usage: bool, logprobs: bool = False) -> None:
        self.id = new_id("chatcmpl")
        self.created = now_s()
        self.include_usage = include_usage
        self.logprobs = logprobs
        self._calling = False
        """A tool call has been streamed: content after it waits for the finish chunk."""
        self._tail: list[Piece] = []

    def _chunk(
        self, model: str, delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def start(self, model: str) -> list[dict[str, Any]]:
        return [self._chunk(model, {"role": "assistant", "content": ""}, None)]

    def piece(self, model: str, piece: Piece) -> dict[str, Any] | None:
        """A content chunk; after a tool call, None: the text goes in the finish chunk, since clients that
        gather calls by index (Home Assistant's) take every chunk after a call's head up to the finish as
        part of a call."""
        if self._calling:
            self._tail.append(piece)
            return None
        return self._chunk(model, {"content": piece.text}, None, chat_logprobs([piece]) if self.logprobs else None)

    def calls(self, model: str, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        """A call's head (index, id, type, name, arguments ""), then a chunk per fragment of its arguments."""
        self._calling = self._calling or bool(deltas)
        events = []
        for d in deltas:
            if d.name is not None:
                head = {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
                events.append(self._chunk(model, {"tool_calls": [head]}, None))
            if d.arguments:
                fragment = {"index": d.index, "function": {"arguments": d.arguments}}
                events.append(self._chunk(model, {"tool_calls": [fragment]}, None))
        return events

    def end(self, r: Result) -> list[dict[str, Any] | str]:
        tail = "".join(p.text for p in self._tail)
        logprobs = chat_logprobs(self._tail) if self.logprobs and tail else None
        events: list[dict[str, Any] | str] = [
            self._chunk(r.model, {"content": tail} if tail else {}, _finish(r), logprobs)
        ]
        if self.include_usage:
            events.append(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": r.model,
                    "system_fingerprint": FINGERPRINT,
                    "choices": [],
                    "usage": _usage(r),
                    "timings": r.timings,
                }
            )
        events.append("[DONE]")
        return events

    def whole(self, r: Result) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": r.message, "refusal": None}
        if r.tool_calls:
            message["content"] = r.message or None
            message["tool_calls"] = [tool_call_json(c) for c in r.tool_calls]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": r.model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": chat_logprobs(r.pieces) if self.logprobs else None,
                    "finish_reason": _finish(r),
                }
            ],
            "usage": _usage(r),
            "timings": r.timings,
        }


class CompletionFormat:
    """``text_completion`` objects (the same shape streamed and not)."""

    def __init__(self, include_usage: bool, logprobs: bool = False) -> None:
        self.id = new_id("cmpl")
        self.created = now_s()
        self.include_usage = include_usage
        self.logprobs = logprobs
        self._offset = 0

    def _obj(self, model: str, text: str, finish: str | None, pieces: list[Piece] | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "text": text,
                    "index": 0,
                    "logprobs": self._logprobs(pieces) if pieces is not None and self.logprobs else None,
                    "finish_reason": finish,
                }
            ],
        }

    def _logprobs(self, pieces: list[Piece]) -> dict[str, Any]:
        """The legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset (characters
        from the start of the generated text; it runs on across a stream's chunks)."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for p in pieces:
            for lp in p.logprobs:
                token = _spelled(lp.piece)
                out["tokens"].append(token)
                out["token_logprobs"].append(lp.logprob)
                out["top_logprobs"].append({_spelled(b): v for _i, b, v in lp.top})
                out["text_offset"].append(self._offset)
                self._offset += len(token)
        return out

    def start(self, model: str) -> list[dict[str, Any]]:
        return []

    def piece(self, model: str, piece: Piece) -> dict[str, Any]:
        return self._obj(model, piece.text, None, [piece])

    def calls(self, model: str, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        return []

    def end(self, r: Result) -> list[dict[str, Any] | str]:
        events: list[dict[str, Any] | str] = [self._obj(r.model, "", r.finish_reason)]
        if self.include_usage:
            events.append({**self._obj(r.model, "", None), "choices": [], "usage": _usage(r), "timings": r.timings})
        events.append("[DONE]")
        return events

    def whole(self, r: Result) -> dict[str, Any]:
        return {**self._obj(r.model, r.text, r.finish_reason, r.pieces), "usage": _usage(r), "timings": r.timings}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """Chat: messages in, one assistant message out (SSE chunks with ``stream: true``)."""
    deps = get_deps(request)
    req = parse_body(await request.body(), ChatRequest)
    req.check_n()
    max_tokens = req.max_completion_tokens or req.max_tokens or deps.config.api.default_max_tokens
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    job = Job(
        req.model,
        request_priority(request, req.priority),
        req.prompt(),
        req.sampling(max_tokens),
        req.stream,
        ChatFormat(include_usage, bool(req.logprobs)),
        extras=req.extras(),
    )
    return GenerationResponse(deps, job)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """Text completion: a prompt in, its continuation out (SSE chunks with ``stream: true``)."""
    deps = get_deps(request)
    req = parse_body(await request.body(), CompletionRequest)
    req.check_n()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    prompt, name = req.text_prompt()
    job = Job(
        req.model,
        request_priority(request, req.priority),
        prompt,
        req.sampling(req.max_tokens or 16),
        req.stream,
        CompletionFormat(include_usage, req.logprobs is not None),
        prompt_param=name,
        extras=req.extras(),
    )
    return GenerationResponse(deps, job)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    """Every configured model: id, roles, backend, state (unloaded/loading/ready/error), memory."""
    deps = get_deps(request)
    data = []
    for m in deps.models.models.values():
        d = m.describe()
        data.append(
            {
                "id": m.id,
                "object": "model",
                "created": 0,
                "owned_by": "genie-supervisor",
                **{
                    k: d[k]
                    for k in (
                        "role",
                        "roles",
                        "backend",
                        "backend_identity",
                        "state",
                        "error",
                        "resident",
                        "group",
                        "n_ctx",
                        "memory",
                        "in_flight",
                    )
                },
            }
        )
    return JSONResponse({"object": "list", "data": data})
