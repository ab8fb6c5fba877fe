"""The operator's controls over HTTP: ``POST /control/policy``, ``/control/llm``, ``/control/reload``.

The same calls as Home Assistant's select, switch and button over MQTT (`ControlActions`); the web
page uses them, and ``POST /unload`` for its unload button. Each answers with the controls' state.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse

from ..errors import BadRequest
from .deps import ControlActions, get_deps
from .server import error_response

router = APIRouter()


async def _control(request: Request, field: str | None = None, kind: type = str) -> tuple[ControlActions, Any]:
    """The controls, and the JSON body's `field` checked to be a `kind` (a 400 naming it otherwise)."""
    c = get_deps(request).controls
    if c is None:
        raise HTTPException(503, "this daemon has no run-time controls")
    if field is None:
        return c, None
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    value = body.get(field) if isinstance(body, dict) else None
    if not isinstance(value, kind):
        what = "true or false" if kind is bool else "a string"
        raise BadRequest(f'the body must be a JSON object whose "{field}" is {what}', field)
    return c, value


def _state(c: ControlActions, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {
            "policy": c.active_policy(),
            "policy_options": list(c.policy_options()),
            "llm_enabled": c.llm_enabled(),
            **extra,
        }
    )


@router.post("/control/policy")
async def select_policy(request: Request) -> JSONResponse:
    """Put a policy file in force: ``{"policy": name}`` (one of ``policy_options``); a bad file changes nothing."""
    c, name = await _control(request, "policy", str)
    try:
        await c.select_policy(name)
    except ValueError as exc:
        raise BadRequest(str(exc), "policy") from None
    return _state(c)


@router.post("/control/llm")
async def set_llm(request: Request) -> JSONResponse:
    """Switch the LLM on or off: ``{"enabled": true|false}`` (off: requests get 503, models unload)."""
    c, enabled = await _control(request, "enabled", bool)
    await c.set_llm_enabled(enabled)
    return _state(c)


@router.post("/control/reload")
async def reload_policy(request: Request) -> JSONResponse:
    """Reload the policy file now (as SIGHUP); 409 with the file's errors when it was rejected."""
    c, _ = await _control(request)
    if not await c.reload_policy():
        error = get_deps(request).status()["policy"]["error"]
        return error_response(
            409, f"the policy was not reloaded: {error or 'no policy file is configured'}", code="policy_rejected"
        )
    return _state(c, reloaded=True)
