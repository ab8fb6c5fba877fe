"""Ollama's wire format: NDJSON lines, ``{"error": ...}`` bodies, and the chat and generate objects.

    job = Job(..., fmt=ChatFormat("smollm2:latest"), framing=NDJSON)

A chat with ``tools`` gets its content as `GenerationResponse` passes it on (up to where a tool call
could begin) and the calls it parsed from the whole output (`Result.tool_calls`), sent as Ollama
does: ``message.tool_calls`` = ``[{"id", "function": {"index", "name", "arguments": {...}}}]``
(arguments an object, not a JSON string), in one line before the final ``done: true`` line.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from fastapi.responses import JSONResponse

from engine.tool_calls import ToolCall
from engine.tool_stream import CallDelta

from ..llm.serving import Piece
from .generation import Framing, Result
from .openai_routes import chat_logprobs


def ollama_error(status: int, message: str) -> JSONResponse:
    """Ollama's error answer: ``{"error": message}`` with `status`."""
    return JSONResponse({"error": message}, status_code=status)


def _line(event: dict[str, Any] | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"{data}\n".encode()


NDJSON = Framing(media_type="application/x-ndjson", event=_line, error=lambda _status, message: {"error": message})
"""One JSON object a line; errors as ``{"error": message}``, streamed or not."""


def created_at() -> str:
    """Now in RFC 3339 with microseconds, as Ollama stamps each line."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class _Base:
    def __init__(self, name: str, logprobs: bool = False) -> None:
        self.name = name
        """The Ollama name the answer carries (``id:latest``)."""
        self.logprobs = logprobs
        """Whether lines carry their tokens' log-probabilities."""
        self.t0 = time.monotonic()

    def _head(self, done: bool, pieces: list[Piece] | None = None) -> dict[str, Any]:
        head: dict[str, Any] = {"model": self.name, "created_at": created_at(), "done": done}
        if self.logprobs and pieces:
            head["logprobs"] = chat_logprobs(pieces)["content"]  # Ollama's entries are OpenAI's
        return head

    def _final(self, r: Result) -> dict[str, Any]:
        return {
            "done_reason": r.finish_reason,
            "total_duration": int((time.monotonic() - self.t0) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": r.prompt_tokens,
            "prompt_eval_duration": int(r.timings.get("prompt_ms", 0.0) * 1e6),
            "eval_count": r.completion_tokens,
            "eval_duration": int(r.timings.get("predicted_ms", 0.0) * 1e6),
        }

    def start(self, model: str) -> list[dict[str, Any]]:
        return []

    def calls(self, model: str, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        return []  # Ollama sends each call whole, in one line at the end


def tool_calls_out(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Ollama's ``tool_calls``: arguments as an object, an id and index per call."""
    return [
        {
            "id": c.id or f"call_{uuid.uuid4().hex[:24]}",
            "function": {"index": i, "name": c.name, "arguments": c.arguments},
        }
        for i, c in enumerate(calls)
    ]


class ChatFormat(_Base):
    """``/api/chat`` lines: ``message`` deltas, the tool calls, then the ``done`` line with counts."""

    def _message(self, content: str, calls: list[ToolCall] | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = tool_calls_out(calls)
        return msg

    def piece(self, model: str, piece: Piece) -> dict[str, Any]:
        return {**self._head(False, [piece]), "message": self._message(piece.text)}

    def end(self, r: Result) -> list[dict[str, Any] | str]:
        lines: list[dict[str, Any] | str] = []
        if r.tool_calls:
            lines.append({**self._head(False), "message": self._message("", r.tool_calls)})
        lines.append({**self._head(True), "message": self._message(""), **self._final(r)})
        return lines

    def whole(self, r: Result) -> dict[str, Any]:
        return {**self._head(True, r.pieces), "message": self._message(r.message, r.tool_calls), **self._final(r)}


class GenerateFormat(_Base):
    """``/api/generate`` lines: ``response`` pieces, then the ``done`` line with counts."""

    def piece(self, model: str, piece: Piece) -> dict[str, Any]:
        return {**self._head(False, [piece]), "response": piece.text}

    def end(self, r: Result) -> list[dict[str, Any] | str]:
        return [{**self._head(True), "response": "", **self._final(r)}]

    def whole(self, r: Result) -> dict[str, Any]:
        return {**self._head(True, r.pieces), "response": r.text, **self._final(r)}
