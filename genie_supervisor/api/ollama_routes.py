"""Ollama-compatible routes beside the OpenAI ones (docs/ollama.md): what Home Assistant's Ollama
integration and the ``ollama`` Python client use.

    GET  /api/version, /api/tags, /api/ps          answered at once (no queue, no gate)
    POST /api/show, /api/pull                       a configured model's card / "success"; else 404
    POST /api/chat, /api/generate                   NDJSON lines (default) or one object (stream: false)
    POST /api/embed, /api/embeddings                501: this daemon serves no embeddings
    GET|HEAD /                                      "Ollama is running"

Generations run as the OpenAI routes' do (`Job` + `GenerationResponse`): the same admission queue,
voice priority (header ``X-Genie-Priority`` or body ``priority``), decode gate and model leases.
Every error is ``{"error": "..."}`` with its status (400 bad body, 404 unknown model, 429/503 busy).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from .. import __version__
from ..errors import AdmissionError
from ..llm.admission import request_priority
from ..llm.managed_model import ManagedModel
from ..llm.serving import RequestExtras
from .deps import ApiDeps, get_deps
from .generation import Formatter, GenerationResponse, Job
from .ollama_format import NDJSON, ChatFormat, GenerateFormat, created_at, ollama_error
from .ollama_models import FOREVER, OllamaNames, model_card, ollama_name, tool_capable
from .ollama_schemas import ChatBody, GenerateBody, GenerationBody, NameBody
from .schemas import parse_body

log = structlog.get_logger(__name__)
router = APIRouter()

OLLAMA_VERSION = "0.12.3"
"""The Ollama version reported: the API shape these routes follow (clients gate features on it)."""


async def _answer(work: Callable[[], Awaitable[Response]]) -> Response:
    """`work()`'s response, or its AdmissionError (bad body, unknown model, busy) in Ollama's shape."""
    try:
        return await work()
    except AdmissionError as exc:
        return ollama_error(exc.status, str(exc))


class _Then(Response):
    """`inner`, then `after()` once the answer has been sent (shielded: the client may be gone)."""

    def __init__(self, inner: Response, after: Callable[[], Awaitable[Any]]) -> None:
        super().__init__()
        self.inner, self.after = inner, after

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.after()


async def _unload_if_not_resident(deps: ApiDeps, m: ManagedModel) -> None:
    """``keep_alive: 0``: unload `m` unless it is resident (resident models are never unloaded here);
    a model still busy past ``api.drain_timeout_s`` stays (logged)."""
    if m.entry.resident:
        return
    try:
        await deps.models.unload(m.id)
    except AdmissionError as exc:
        log.warning("keep_alive_unload_failed", model=m.id, error=str(exc))


def _keep_alive_zero(seconds: float | None) -> bool:
    return seconds is not None and seconds == 0


async def _load_only(deps: ApiDeps, name: str, m: ManagedModel, keep_alive_s: float | None, chat: bool) -> Response:
    """An empty request: load the model (``done_reason: load``), or with ``keep_alive: 0`` unload it."""
    if _keep_alive_zero(keep_alive_s) and not m.entry.resident:
        await _unload_if_not_resident(deps, m)
        reason = "unload"
    else:  # a resident model stays loaded whatever keep_alive says
        async with deps.models.lease(m):
            reason = "load"
    body: dict[str, Any] = {"model": name, "created_at": created_at(), "done": True, "done_reason": reason}
    body.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return JSONResponse(body)


def _generation(deps: ApiDeps, job: Job, m: ManagedModel, keep_alive_s: float | None) -> Response:
    response = GenerationResponse(deps, job)
    if _keep_alive_zero(keep_alive_s):
        return _Then(response, lambda: _unload_if_not_resident(deps, m))
    return response


@router.api_route("/", methods=["GET", "HEAD"])
async def root() -> PlainTextResponse:
    """What clients probe to see an Ollama server."""
    return PlainTextResponse("Ollama is running")


@router.get("/api/version")
async def version() -> JSONResponse:
    """The Ollama API version these routes follow (and the daemon's own)."""
    return JSONResponse({"version": OLLAMA_VERSION, "genie_supervisor": __version__})


@router.get("/api/tags")
async def tags(request: Request) -> JSONResponse:
    """Every model id and role as ``name:latest`` with size, digest and GGUF details (loaded or not)."""
    names = OllamaNames(get_deps(request).models)
    out = []
    for name, m in names.listed():
        card = await model_card(m)
        out.append(
            {
                "name": name,
                "model": name,
                "modified_at": card.modified_at,
                "size": card.size,
                "digest": card.digest,
                "details": card.details,
            }
        )
    return JSONResponse({"models": out})


def _expires_at(m: ManagedModel) -> str:
    if m.entry.resident or not m.entry.ttl_s:
        return FOREVER
    at = time.time() - (time.monotonic() - m.last_used) + m.entry.ttl_s
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


@router.get("/api/ps")
async def ps(request: Request) -> JSONResponse:
    """The loaded models: memory planned (VRAM on the GPU backend), context, when they unload."""
    names = OllamaNames(get_deps(request).models)
    out, seen = [], set()
    for name, m in names.listed():
        if m.state != "ready" or m.id in seen:
            continue
        seen.add(m.id)
        card = await model_card(m)
        size = m.plan.total if m.plan else card.size
        on_gpu = m.backend.describe().get("compute") == "cupy"
        out.append(
            {
                "name": name,
                "model": name,
                "size": size,
                "digest": card.digest,
                "details": card.details,
                "expires_at": _expires_at(m),
                "size_vram": size if on_gpu else 0,
                "context_length": m.backend.n_ctx,
            }
        )
    return JSONResponse({"models": out})


@router.post("/api/show")
async def show(request: Request) -> Response:
    """A model's details, GGUF metadata (large arrays left out), chat template and capabilities."""

    async def work() -> Response:
        body = parse_body(await request.body(), NameBody)
        name = body.which()
        m = OllamaNames(get_deps(request).models).resolve(name)
        card = await model_card(m)
        n_ctx = m.backend.n_ctx
        template = card.template.replace('"""', '\\"\\"\\"')
        modelfile = (
            "# Modelfile generated by genie-supervisor (the TEMPLATE is the GGUF's Jinja chat template)\n"
            f"FROM {m.entry.path or m.id}\n"
            f'TEMPLATE """{template}"""\n'
            f"PARAMETER num_ctx {n_ctx}\n"
        )
        return JSONResponse(
            {
                "modelfile": modelfile,
                "parameters": f"{'num_ctx':<30} {n_ctx}",
                "template": card.template,
                "license": str(card.model_info.get("general.license", "")),
                "details": card.details,
                "model_info": card.model_info,
                "capabilities": ["completion", "tools"] if tool_capable(m) else ["completion"],
                "modified_at": card.modified_at,
            }
        )

    return await _answer(work)


PULL_STEPS = ("pulling manifest", "verifying sha256 digest", "writing manifest", "success")
"""The status lines of a pull of a model the daemon already has."""


@router.post("/api/pull")
async def pull(request: Request) -> Response:
    """A configured model: Ollama's status lines ending in ``success`` (nothing is downloaded); else 404."""

    async def work() -> Response:
        body = parse_body(await request.body(), NameBody)
        name = body.which()
        try:
            OllamaNames(get_deps(request).models).resolve(name)
        except AdmissionError as exc:
            return ollama_error(404, f"{exc}; this daemon cannot download models (add it to the config)")
        if not body.stream:
            return JSONResponse({"status": "success"})
        lines = (NDJSON.event({"status": s}) for s in PULL_STEPS)
        return StreamingResponse(lines, media_type=NDJSON.media_type)

    return await _answer(work)


@router.post("/api/embed")
@router.post("/api/embeddings")
async def embed() -> JSONResponse:
    """Not offered: the configured models are chat models, and a mean of their hidden states is no embedding."""
    return ollama_error(501, "embeddings are not supported by this daemon (its models are chat models)")


@router.post("/api/create")
@router.post("/api/copy")
@router.post("/api/push")
@router.delete("/api/delete")
async def manage_files() -> JSONResponse:
    """Not offered: the config names the models; the daemon does not create, copy, push or delete them."""
    return ollama_error(501, "this daemon serves the models its config names; it does not manage model files")


Body = TypeVar("Body", bound=GenerationBody)


async def _ollama_job(
    request: Request, kind: type[Body], parts: Callable[[Body, str], tuple[Any, RequestExtras, Formatter]]
) -> Response:
    """One /api/chat or /api/generate request: the body checked, the model resolved, an empty request loading
    it, else a `Job` with `parts` (prompt, extras, format), unloading after with ``keep_alive: 0``."""

    async def work() -> Response:
        deps = get_deps(request)
        body = parse_body(await request.body(), kind)
        name = ollama_name(body.model)
        m = OllamaNames(deps.models).resolve(body.model)
        body.check_offered()
        keep_alive_s = body.keep_alive_s()
        if body.load_only():
            return await _load_only(deps, name, m, keep_alive_s, chat=isinstance(body, ChatBody))
        prompt, extras, fmt = parts(body, name)
        sampling = body.sampling(deps.config.api.default_max_tokens)
        priority = request_priority(request, body.priority)
        job = Job(m.id, priority, prompt, sampling, body.stream, fmt, extras=extras, framing=NDJSON)
        return _generation(deps, job, m, keep_alive_s)

    return await _answer(work)


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    """Chat: messages (and tools) in, the assistant's message out, as NDJSON lines or one object."""

    def parts(body: ChatBody, name: str) -> tuple[Any, RequestExtras, Formatter]:
        return body.prompt(), body.extras(), ChatFormat(name, body.logprobs)

    return await _ollama_job(request, ChatBody, parts)


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    """Completion: a prompt (templated as a user turn unless ``raw``) in, its continuation out."""

    def parts(body: GenerateBody, name: str) -> tuple[Any, RequestExtras, Formatter]:
        extras = RequestExtras(grammar=body.grammar(), grammar_param="format")
        return body.text_or_messages(), extras, GenerateFormat(name, body.logprobs)

    return await _ollama_job(request, GenerateBody, parts)
