"""llama-server's helper routes: ``POST /tokenize``, ``/detokenize``, ``/apply-template``, ``GET /props``, ``/slots``.

The builtin engine answers them from the model itself (its tokenizer and chat template); a model
served by llama-server has them passed on to it. Each names its model by the body's (or, for the
GET routes, the query's) ``model`` as generation requests do (unknown names: `ModelManager.resolve`
with ``fallback``); the POST routes load the model if it is not loaded, the GET routes only read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engine import Model, SamplingParams
from engine.tool_calls import template_supports_tools

from ..errors import BackendUnavailable, BadRequest, UpstreamError
from ..llm.managed_model import ManagedModel
from .deps import ApiDeps, get_deps
from .llama_routes import generation_settings
from .schemas import NAME_CHARS, ChatRequest, check_token_ids, parse_body
from .server import error_response

router = APIRouter()

FORWARD_TIMEOUT_S = 30.0
"""Deadline of one helper request passed on to llama-server."""
MAX_TOKENS = 1_048_576
"""Most token ids one /detokenize may give."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, defer_build=True)  # as api.schemas

    model: str | None = Field(None, max_length=NAME_CHARS, description="model id or role (an extension)")


class TokenizeRequest(_Body):
    """``POST /tokenize``."""

    content: str = Field(..., description="the text to tokenize")
    add_special: bool = Field(False, description="add the model's BOS (as a prompt gets it)")
    parse_special: bool = Field(True, description="text spelling a special token (<|im_start|>) is that token")
    with_pieces: bool = Field(False, description="each token as {id, piece}")


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    tokens: list[int] = Field(..., max_length=MAX_TOKENS, description="token ids in 0..n_vocab-1")


def _engine_model(m: ManagedModel) -> Model | None:
    """The engine's model when the builtin backend serves `m` and it is loaded (None otherwise)."""
    host = getattr(m.backend, "host", None)
    model = getattr(host, "model", None)
    return model if isinstance(model, Model) else None


async def _forward(m: ManagedModel, method: str, path: str, body: Any = None) -> JSONResponse:
    """The same request passed on to the llama-server serving `m`, and its answer."""
    base = getattr(m.backend, "base_url", None)
    if base is None:
        raise BackendUnavailable(f"model {m.id!r} is not served by an engine this route can ask")
    import httpx  # imported already by the llama-server backend that serves `m` (llm.llama_cpp)

    try:
        async with httpx.AsyncClient(timeout=FORWARD_TIMEOUT_S) as client:
            r = await client.request(method, f"{base}{path}", json=body)
    except httpx.HTTPError as exc:
        raise BackendUnavailable(f"llama-server at {base}: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise UpstreamError(r.status_code, f"llama-server {path}: {r.text[:300]}")
    return JSONResponse(r.json())


async def _leased_call(
    deps: ApiDeps, name: str | None, path: str, raw: dict[str, Any], work: Callable[[Model], dict[str, Any]]
) -> JSONResponse:
    """Run `work(model)` in a thread on the named model (loaded for it if needed), or pass the request on."""
    m = deps.models.resolve(name, fallback=True)
    async with deps.models.lease(m):
        model = _engine_model(m)
        if model is None:
            return await _forward(m, "POST", path, raw)
        return JSONResponse(await anyio.to_thread.run_sync(work, model))


def _spelled(piece: bytes) -> str | list[int]:
    """A token's text, or its bytes when they are not UTF-8 on their own (as llama-server writes it)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    """Text to token ids (``with_pieces``: ``[{"id", "piece"}]``), with the model's own tokenizer."""
    raw = await request.body()
    req = parse_body(raw, TokenizeRequest)

    def work(model: Model) -> dict[str, Any]:
        tok = model.tokenizer
        ids = tok.encode(req.content, add_special=req.add_special, parse_special=req.parse_special)
        if not req.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": _spelled(tok.token_to_bytes(i))} for i in ids]}

    return await _leased_call(get_deps(request), req.model, "/tokenize", req.model_dump(exclude={"model"}), work)


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    """Token ids to text (special tokens spelled out, as llama-server does)."""
    req = parse_body(await request.body(), DetokenizeRequest)

    def work(model: Model) -> dict[str, Any]:
        check_token_ids(req.tokens, model.tokenizer.n_vocab, "tokens")
        return {"content": model.tokenizer.decode(req.tokens)}

    return await _leased_call(get_deps(request), req.model, "/detokenize", {"tokens": req.tokens}, work)


@router.post("/apply-template")
async def apply_template(request: Request) -> JSONResponse:
    """Chat messages (and ``tools``) to the prompt text the model's chat template makes of them."""
    raw = await request.body()
    req = parse_body(raw, ChatRequest)
    messages, extras = req.prompt(), req.extras()
    tools = [dict(t) for t in extras.tools] if extras.tools_active else None

    def work(model: Model) -> dict[str, Any]:
        return {"prompt": model.render_chat(messages, tools=tools)}

    body = {"messages": messages, **({"tools": tools} if tools else {})}
    return await _leased_call(get_deps(request), req.model, "/apply-template", body, work)


def _default_settings(deps: ApiDeps, m: ManagedModel) -> dict[str, Any]:
    sampling = SamplingParams(max_tokens=deps.config.api.default_max_tokens)
    return generation_settings(sampling, n_predict=-1, n_ctx=m.backend.n_ctx, model=m.id)


def _slot(deps: ApiDeps, index: int, m: ManagedModel) -> dict[str, Any]:
    """One model as llama-server's slot (the engine runs one generation per model at a time)."""
    busy = m.in_flight > 0
    return {
        "id": index,
        "id_task": -1,
        "model": m.id,
        "state": m.state,
        "n_ctx": m.backend.n_ctx,
        "speculative": False,
        "is_processing": busy,
        "params": _default_settings(deps, m),
        "prompt": "",
        "next_token": {
            "has_next_token": busy,
            "has_new_line": False,
            "n_remain": -1,
            "n_decoded": 0,
            "stopping_word": "",
        },
    }


# The query parameters are read from the request, not declared: FastAPI's analysis of a declared one
# imports pydantic.v1 (about 20 ms and 30 modules of the daemon's start; tests/test_import_cost.py).
@router.get("/props")
async def props(request: Request) -> JSONResponse:
    """The model's properties as llama-server's ``/props`` gives them (read only: nothing is loaded);
    ``?model=`` names the model (an id or a role)."""
    deps = get_deps(request)
    m = deps.models.resolve(request.query_params.get("model"), fallback=True)
    if m.kind == "llama_cpp" and m.state == "ready" and not m.draining:
        async with deps.models.lease(m):
            return await _forward(m, "GET", "/props")
    engine = _engine_model(m)
    template = engine.chat_template if engine is not None else None
    tok = engine.tokenizer if engine is not None else None
    return JSONResponse(
        {
            "default_generation_settings": _slot(deps, 0, m),
            "total_slots": 1,
            "model": m.id,
            "model_path": m.entry.path,
            "n_ctx": m.backend.n_ctx,
            "chat_template": template,
            "chat_template_caps": {"supports_tools": template_supports_tools(template)} if engine else {},
            "bos_token": tok.decode([tok.bos_id]) if tok is not None and tok.bos_id is not None else None,
            "eos_token": tok.decode([tok.eos_id]) if tok is not None and tok.eos_id is not None else None,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"genie-supervisor {deps.version}",
            "is_sleeping": m.state != "ready",
        }
    )


@router.get("/slots")
async def slots(request: Request) -> JSONResponse:
    """One slot per configured model with its state (read only); ``?fail_on_no_slot=1``: 503 when all are busy."""
    try:
        fail_on_no_slot = int(request.query_params.get("fail_on_no_slot", "0"))
    except ValueError:
        raise BadRequest("fail_on_no_slot must be an integer", "fail_on_no_slot") from None
    deps = get_deps(request)
    out = [_slot(deps, i, m) for i, m in enumerate(deps.models.models.values())]
    if fail_on_no_slot and all(s["is_processing"] for s in out):
        return error_response(503, "no slot available", code="no_slot_available")
    return JSONResponse(out)
