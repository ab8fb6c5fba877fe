"""OpenAI-compatible routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..llm.admission import PRIORITY_HEADER
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


class ChatFormat:
    """``chat.completion`` and ``chat.completion.chunk`` objects."""

    def __init__(self, include_usage: bool) -> None:
        self.id = new_id("chatcmpl")
        self.created = now_s()
        self.include_usage = include_usage

    def _chunk(self, model: str, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            out["usage"] = None
        return out

    def start(self, model: str) -> list[dict[str, Any]]:
        return [self._chunk(model, {"role": "assistant", "content": ""}, None)]

    def piece(self, model: str, piece: Piece) -> dict[str, Any]:
        return self._chunk(model, {"content": piece.text}, None)

    def end(self, r: Result) -> list[dict[str, Any] | str]:
        events: list[dict[str, Any] | str] = [self._chunk(r.model, {}, r.finish_reason)]
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
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": r.model,
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": r.text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                }
            ],
            "usage": _usage(r),
            "timings": r.timings,
        }


class CompletionFormat:
    """``text_completion`` objects (the same shape streamed and not)."""

    def __init__(self, include_usage: bool) -> None:
        self.id = new_id("cmpl")
        self.created = now_s()
        self.include_usage = include_usage

    def _obj(self, model: str, text: str, finish: str | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
        }

    def start(self, model: str) -> list[dict[str, Any]]:
        return []

    def piece(self, model: str, piece: Piece) -> dict[str, Any]:
        return self._obj(model, piece.text, None)

    def end(self, r: Result) -> list[dict[str, Any] | str]:
        events: list[dict[str, Any] | str] = [self._obj(r.model, "", r.finish_reason)]
        if self.include_usage:
            events.append({**self._obj(r.model, "", None), "choices": [], "usage": _usage(r), "timings": r.timings})
        events.append("[DONE]")
        return events

    def whole(self, r: Result) -> dict[str, Any]:
        return {**self._obj(r.model, r.text, r.finish_reason), "usage": _usage(r), "timings": r.timings}


def _priority(request: Request, body_priority: str | None) -> str | None:
    return request.headers.get(PRIORITY_HEADER) or body_priority


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
        _priority(request, req.priority),
        req.prompt(),
        req.sampling(max_tokens),
        req.stream,
        ChatFormat(include_usage),
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
        _priority(request, req.priority),
        prompt,
        req.sampling(req.max_tokens or 16),
        req.stream,
        CompletionFormat(include_usage),
        prompt_param=name,
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
