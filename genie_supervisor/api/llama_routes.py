"""llama-server's native ``POST /completion`` (request and response shape), on any backend."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..errors import BadRequest
from ..llm.admission import PRIORITY_HEADER
from ..llm.serving import Piece
from .deps import get_deps
from .generation import GenerationResponse, Job, Result
from .schemas import LlamaCompletionRequest, parse_body

router = APIRouter()


class LlamaFormat:
    """``{"content", "stop", "tokens_predicted", "tokens_evaluated", "stop_type", "timings", ...}``."""

    def __init__(self, req: LlamaCompletionRequest) -> None:
        self.req = req

    def start(self, model: str) -> list[dict[str, Any]]:
        return []

    def piece(self, model: str, piece: Piece) -> dict[str, Any]:
        return {"content": piece.text, "stop": False, "id_slot": 0, "index": 0}

    def _final(self, r: Result, content: str) -> dict[str, Any]:
        stop_type = {"length": "limit", "stop": "eos"}.get(r.finish_reason, "none")
        if r.finish_reason == "stop" and self.req.stop and any(r.text.endswith(s) for s in self.req.stop):
            stop_type = "word"
        t = r.timings
        prompt_n, predicted_n = int(t.get("prompt_n", r.prompt_tokens)), int(t.get("predicted_n", r.completion_tokens))
        prompt_ms, predicted_ms = float(t.get("prompt_ms", 0.0)), float(t.get("predicted_ms", 0.0))
        return {
            "content": content,
            "id_slot": 0,
            "index": 0,
            "stop": True,
            "model": r.model,
            "tokens_predicted": r.completion_tokens,
            "tokens_evaluated": r.prompt_tokens,
            "tokens_cached": int(t.get("cache_n", 0)),
            "truncated": False,
            "has_new_line": "\n" in r.text,
            "stop_type": stop_type,
            "stopping_word": "",
            "generation_settings": {
                "n_predict": self.req.n_predict,
                "temperature": self.req.temperature,
                "top_k": self.req.top_k,
                "top_p": self.req.top_p,
                "min_p": self.req.min_p,
                "seed": self.req.seed,
                "stop": self.req.stop,
                "model": r.model,
            },
            "timings": {
                "prompt_n": prompt_n,
                "prompt_ms": round(prompt_ms, 3),
                "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
                "prompt_per_second": round(prompt_n * 1000.0 / prompt_ms, 3) if prompt_ms else 0.0,
                "predicted_n": predicted_n,
                "predicted_ms": round(predicted_ms, 3),
                "predicted_per_token_ms": round(predicted_ms / predicted_n, 3) if predicted_n else 0.0,
                "predicted_per_second": round(predicted_n * 1000.0 / predicted_ms, 3) if predicted_ms else 0.0,
            },
        }

    def end(self, r: Result) -> list[dict[str, Any] | str]:
        return [self._final(r, "")]

    def whole(self, r: Result) -> dict[str, Any]:
        return self._final(r, r.text)


@router.post("/completion")
async def completion(request: Request) -> Response:
    """llama-server's completion: ``prompt`` and ``n_predict`` in, ``content`` and counts out."""
    deps = get_deps(request)
    req = parse_body(await request.body(), LlamaCompletionRequest)
    prompt: Any = req.prompt
    if not prompt:
        raise BadRequest("the prompt is empty", "prompt")
    job = Job(
        req.model,
        request.headers.get(PRIORITY_HEADER) or req.priority,
        prompt,
        req.sampling(deps.config.api.default_max_tokens),
        req.stream,
        LlamaFormat(req),
    )
    return GenerationResponse(deps, job)
