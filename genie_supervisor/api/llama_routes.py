"""llama-server's native ``POST /completion`` (request and response shape), on any backend, and
llama-server's unprefixed aliases of the OpenAI routes (``/chat/completions``, ``/completions``, ``/models``)."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine import SamplingParams
from engine.tool_stream import CallDelta

from ..errors import BadRequest
from ..llm.admission import request_priority
from ..llm.serving import NO_EXTRAS, Piece, RequestExtras, TokenLogprob
from . import openai_routes
from .deps import get_deps
from .generation import GenerationResponse, Job, Result
from .schemas import LlamaCompletionRequest, parse_body

if TYPE_CHECKING:
    from .deps import ApiDeps

router = APIRouter()

for _path, _route, _method in (
    ("/chat/completions", openai_routes.chat_completions, "POST"),
    ("/completions", openai_routes.completions, "POST"),
    ("/models", openai_routes.list_models, "GET"),
):  # llama-server serves the OpenAI routes without the /v1 prefix too: the same handlers
    router.add_api_route(_path, _route, methods=[_method])

SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]
"""The samplers in the order the engine applies them (llama-server's names)."""


def _number(x: float) -> float | None:
    """A float JSON can carry (a ban's -inf is null, as llama-server writes it)."""
    return x if math.isfinite(x) else None


def generation_settings(
    sampling: SamplingParams,
    *,
    n_predict: int,
    stream: bool = False,
    extras: RequestExtras = NO_EXTRAS,
    n_ctx: int | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """llama-server's ``generation_settings`` (also /props' ``default_generation_settings.params``):
    what the engine applies, and llama-server's samplers the engine lacks at their "off" values."""
    grammar = extras.grammar
    kind = getattr(grammar, "kind", None)
    schema: Any = None
    if kind in ("json_schema", "json_object"):
        schema = json.loads(grammar.source) if grammar.source else {"type": "object"}
    return {
        "n_ctx": n_ctx,
        "n_predict": n_predict,
        "model": model,
        "seed": -1 if sampling.seed is None else sampling.seed,
        "temperature": sampling.temperature,
        "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "xtc_threshold": 0.1,
        "typical_p": 1.0,
        "repeat_last_n": sampling.repeat_last_n,
        "repeat_penalty": sampling.repeat_penalty,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "dry_multiplier": 0.0,
        "dry_base": 1.75,
        "dry_allowed_length": 2,
        "dry_penalty_last_n": -1,
        "dry_sequence_breakers": ["\n", ":", '"', "*"],
        "mirostat": 0,
        "mirostat_tau": 5.0,
        "mirostat_eta": 0.1,
        "stop": list(sampling.stop),
        "max_tokens": sampling.max_tokens,
        "n_keep": 0,
        "n_discard": 0,
        "ignore_eos": sampling.ignore_eos,
        "stream": stream,
        "logit_bias": [{"bias": _number(b), "token": t} for t, b in sampling.logit_bias],
        "n_probs": sampling.logprobs or 0,
        "min_keep": 0,
        "grammar": grammar.source if kind in ("gbnf", "lark") else "",
        "json_schema": schema,
        "samplers": SAMPLERS,
        "timings_per_token": False,
        "post_sampling_probs": False,
        "lora": [],
    }


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def probabilities(logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities``: per token its id, text, bytes, logprob and the top ones."""
    return [
        {
            "id": lp.token,
            "token": _text(lp.piece),
            "bytes": list(lp.piece),
            "logprob": _number(lp.logprob),
            "top_logprobs": [
                {"id": t, "token": _text(b), "bytes": list(b), "logprob": _number(p)} for t, b, p in lp.top
            ],
        }
        for lp in logprobs
    ]


class LlamaFormat:
    """``{"content", "tokens", "stop", "tokens_predicted", "tokens_evaluated", "stop_type", "timings", ...}``."""

    def __init__(
        self, req: LlamaCompletionRequest, sampling: SamplingParams, extras: RequestExtras, deps: ApiDeps
    ) -> None:
        self.req = req
        self.sampling = sampling
        self.extras = extras
        self.deps = deps
        self.predicted = 0
        """Tokens streamed so far."""

    def start(self, model: str) -> list[dict[str, Any]]:
        return []

    def calls(self, model: str, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        return []  # /completion takes no tools

    def piece(self, model: str, piece: Piece) -> dict[str, Any]:
        self.predicted += len(piece.tokens)
        out: dict[str, Any] = {
            "index": 0,
            "content": piece.text,
            "tokens": list(piece.tokens),
            "stop": False,
            "id_slot": 0,
            "tokens_predicted": self.predicted,
        }
        if self.sampling.logprobs:
            out["completion_probabilities"] = probabilities(piece.logprobs)
        return out

    def _n_ctx(self, model_id: str) -> int | None:
        m = self.deps.models.models.get(model_id)
        return m.backend.n_ctx if m is not None else None

    def _final(self, r: Result, content: str, tokens: list[int]) -> dict[str, Any]:
        stop_type = {"length": "limit", "stop": "eos"}.get(r.finish_reason, "none")
        if r.finish_reason == "stop" and self.req.stop and any(r.text.endswith(s) for s in self.req.stop):
            stop_type = "word"
        t = r.timings
        prompt_n, predicted_n = int(t.get("prompt_n", r.prompt_tokens)), int(t.get("predicted_n", r.completion_tokens))
        prompt_ms, predicted_ms = float(t.get("prompt_ms", 0.0)), float(t.get("predicted_ms", 0.0))
        prompt_ps = float(t.get("prompt_per_second") or (prompt_n * 1000.0 / prompt_ms if prompt_ms else 0.0))
        # decode speed over the n-1 decode steps: the first token comes out of the prefill
        steps = max(0, predicted_n - 1)
        predicted_ps = float(t.get("predicted_per_second") or (steps * 1000.0 / predicted_ms if predicted_ms else 0.0))
        out: dict[str, Any] = {
            "index": 0,
            "content": content,
            "tokens": tokens,
            "id_slot": 0,
            "stop": True,
            "model": r.model,
            "tokens_predicted": r.completion_tokens,
            "tokens_evaluated": r.prompt_tokens,
            "tokens_cached": int(t.get("cache_n", 0)),
            "truncated": False,
            "has_new_line": "\n" in r.text,
            "stop_type": stop_type,
            "stopping_word": "",
            "generation_settings": generation_settings(
                self.sampling,
                n_predict=self.req.n_predict,
                stream=self.req.stream,
                extras=self.extras,
                n_ctx=self._n_ctx(r.model),
                model=r.model,
            ),
            "timings": {
                "cache_n": int(t.get("cache_n", 0)),
                "prompt_n": prompt_n,
                "prompt_ms": round(prompt_ms, 3),
                "prompt_per_token_ms": round(prompt_ms / prompt_n, 3) if prompt_n else 0.0,
                "prompt_per_second": round(prompt_ps, 3),
                "predicted_n": predicted_n,
                "predicted_ms": round(predicted_ms, 3),
                "predicted_per_token_ms": round(1000.0 / predicted_ps, 3) if predicted_ps else 0.0,
                "predicted_per_second": round(predicted_ps, 3),
            },
        }
        return out

    def end(self, r: Result) -> list[dict[str, Any] | str]:
        return [self._final(r, "", [])]  # as llama-server: the tokens went out in the chunks

    def whole(self, r: Result) -> dict[str, Any]:
        out = self._final(r, r.text, list(r.tokens))
        if self.sampling.logprobs:
            out["completion_probabilities"] = probabilities(tuple(lp for p in r.pieces for lp in p.logprobs))
        return out


@router.post("/completion")
async def completion(request: Request) -> Response:
    """llama-server's completion: ``prompt`` and ``n_predict`` in, ``content`` and counts out."""
    deps = get_deps(request)
    req = parse_body(await request.body(), LlamaCompletionRequest)
    prompt: Any = req.prompt
    if not prompt:
        raise BadRequest("the prompt is empty", "prompt")
    sampling, extras = req.sampling(deps.config.api.default_max_tokens), req.extras()
    job = Job(
        req.model,
        request_priority(request, req.priority),
        prompt,
        sampling,
        req.stream,
        LlamaFormat(req, sampling, extras, deps),
        extras=extras,
    )
    return GenerationResponse(deps, job)
