"""The operator's controls over HTTP: ``POST /control/policy``, ``/control/llm``, ``/control/reload``.

The same calls as Home Assistant's select, switch and button over MQTT (`ControlActions`); the web
page uses them, and ``POST /unload`` for its unload button. Each answers with the controls' state.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..errors import BadRequest
from .deps import ControlActions, get_deps
from .server import error_response

router = APIRouter()


async def _body(request: Request, example: str) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object like {example}")
    return body


def _state(c: ControlActions, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {
            "policy": c.active_policy(),
            "policy_options": list(c.policy_options()),
            "llm_enabled": c.llm_enabled(),
            **extra,
        }
    )


def _controls(request: Request) -> ControlActions | JSONResponse:
    c = get_deps(request).controls
    if c is None:
        return error_response(503, "this daemon has no run-time controls", code="controls_unavailable")
    return c


@router.post("/control/policy")
async def select_policy(request: Request) -> JSONResponse:
    """Put a policy file in force: ``{"policy": name}`` (one of ``policy_options``); a bad file changes nothing."""
    c = _controls(request)
    if isinstance(c, JSONResponse):
        return c
    name = (await _body(request, '{"policy": "default"}')).get("policy")
    if not isinstance(name, str):
        raise BadRequest("policy must be a string: one of " + ", ".join(c.policy_options()), "policy")
    try:
        await c.select_policy(name)
    except ValueError as exc:
        raise BadRequest(str(exc), "policy") from None
    return _state(c)


@router.post("/control/llm")
async def set_llm(request: Request) -> JSONResponse:
    """Switch the LLM on or off: ``{"enabled": true|false}`` (off: requests get 503, models unload)."""
    c = _controls(request)
    if isinstance(c, JSONResponse):
        return c
    enabled = (await _body(request, '{"enabled": false}')).get("enabled")
    if not isinstance(enabled, bool):
        raise BadRequest("enabled must be true or false", "enabled")
    await c.set_llm_enabled(enabled)
    return _state(c)


@router.post("/control/reload")
async def reload_policy(request: Request) -> JSONResponse:
    """Reload the policy file now (as SIGHUP); 409 with the file's errors when it was rejected."""
    c = _controls(request)
    if isinstance(c, JSONResponse):
        return c
    if not await c.reload_policy():
        error = get_deps(request).status()["policy"]["error"]
        return error_response(
            409, f"the policy was not reloaded: {error or 'no policy file is configured'}", code="policy_rejected"
        )
    return _state(c, reloaded=True)
