"""Operations routes: ``GET /health``, ``GET /status``, ``POST /v1/voice/events``."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .deps import get_deps
from .server import error_response

router = APIRouter()


def jsonable(value: Any) -> Any:
    """Observations, decisions and snapshots as plain JSON values (sets sorted, inf/nan as null)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Readiness and identity: 200 once the resident models are ready (or none is configured), 503
    before that (``loading``, as llama-server while it loads its model) and while a model loads or failed."""
    deps = get_deps(request)
    engine = deps.models.describe()
    state = engine["state"]
    status = {"loading": "loading", "error": "error"}.get(state, "ok" if deps.models.started else "loading")
    body = {
        "status": status,
        "backend": engine["backend"],
        "backend_kind": engine.get("backend_kind"),
        "backend_identity": engine.get("backend_identity"),
        "fallback": engine.get("fallback"),
        "fell_back": engine.get("fell_back", False),
        "remotes": engine.get("remotes", {}),
        "models": {m.id: m.state for m in deps.models.models.values()},
        "model": engine["model"],
        "engine": state,
        "gate": deps.gate.mode,
        "gate_reasons": sorted(deps.gate.reasons),
        "policy": deps.policy().name,
        "uptime_s": round(deps.uptime_s(), 3),
        "version": deps.version,
    }
    return JSONResponse(body, status_code=200 if status == "ok" else 503)


@router.get("/status")
async def status(request: Request) -> JSONResponse:
    """The full snapshot: telemetry, services, voice, engine, gate, policy, decision, memory plan."""
    return JSONResponse(get_deps(request).status())


@router.post("/v1/voice/events")
async def voice_event(request: Request) -> JSONResponse:
    """A voice hint ``{"service": "stt"|"tts", "event": "start"|"stop", "session"?: str}``."""
    deps = get_deps(request)
    raw = await request.body()
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return error_response(400, f"the body must be JSON: {exc}")
    try:
        activity = deps.voice.handle(payload, "http")
    except ValueError as exc:
        return error_response(400, str(exc))
    return JSONResponse(
        {
            "ok": True,
            "service": activity.service,
            "active": activity.active,
            "session": activity.session,
            "ts": activity.ts,
        }
    )
