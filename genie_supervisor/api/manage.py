"""Model management routes: ``GET /running``, ``POST /unload``, ``GET /metrics``."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..errors import BadRequest
from .deps import get_deps

router = APIRouter()


@router.get("/running")
async def running(request: Request) -> JSONResponse:
    """Models loaded or loading now, with their requests, and the admission queue."""
    deps = get_deps(request)
    models = [m.describe() for m in deps.models.models.values() if m.state in ("ready", "loading")]
    return JSONResponse({"running": models, "admission": deps.admission.describe()})


@router.post("/unload")
async def unload(request: Request) -> JSONResponse:
    """Unload one model (``{"model": id-or-role}``) or all; drains running requests unless ``"force": true``."""
    deps = get_deps(request)
    raw = await request.body()
    body: object = {}
    if raw.strip():
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest('the body must be a JSON object like {"model": "brain", "force": false}')
    model, force = body.get("model"), body.get("force", False)
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string (an id or a role)", "model")
    if not isinstance(force, bool):
        raise BadRequest("force must be true or false", "force")
    done = await deps.models.unload(model, force=force)
    return JSONResponse({"unloaded": done, "force": force})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text format: models, admission, tokens, speeds, gate, voice events."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # the first scrape imports it

    from .metrics import registry_of

    return Response(generate_latest(registry_of(request.app.state)), media_type=CONTENT_TYPE_LATEST)
