"""The web page: ``GET /ui``, its files under ``/ui/static/``, ``POST /ui/token`` and the stream ``GET /ui/events``.

The page and its files need no key (they hold no data); the stream and the controls do when one is
configured (security.py). The files are read from the installed package once and kept in memory.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from .deps import get_deps
from .server import error_response

router = APIRouter()

TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
"""Content types of the files the page is made of."""
CHARTS = '<link rel="stylesheet" href="/ui/static/vendor/uPlot.min.css">\n<script src="/ui/static/vendor/uPlot.iife.min.js"></script>'
"""What takes the place of ``<!--charts-->`` in the page when the charting library is installed."""
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'; "
    "base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
"""Headers of every page file: nothing but this daemon may load into or frame the page."""


@functools.lru_cache(maxsize=16)
def static_file(path: str) -> bytes | None:
    """The bytes of ``static/<path>`` in the installed package (None when absent; only plain names below it)."""
    parts = path.split("/")
    if not path or any(p in ("", ".", "..") or p.startswith(".") for p in parts) or len(parts) > 2:
        return None
    node = resources.files("genie_supervisor.ui").joinpath("static", *parts)
    return node.read_bytes() if node.is_file() else None


def page() -> str:
    """The page's HTML, with the charting library's tags when it is installed."""
    html = (static_file("index.html") or b"").decode("utf-8")
    return html.replace("<!--charts-->", CHARTS if static_file("vendor/uPlot.iife.min.js") else "")


@router.get("/ui")
def ui_page() -> HTMLResponse:
    """The live page (a plain def: FastAPI runs it in a worker thread, so a file read never blocks the loop)."""
    return HTMLResponse(page(), headers=SECURITY_HEADERS)


@router.get("/ui/static/{path:path}")
def ui_static(request: Request) -> Response:
    """A file of the page (script, stylesheet, the charting library); read in a worker thread, as ui_page
    (`path` read from the request, not declared: see api.llama_extra's /props)."""
    path: str = request.path_params["path"]
    body = static_file(path)
    kind = TYPES.get(path[path.rfind(".") :]) if "." in path else None
    if body is None or kind is None:
        return error_response(404, f"no such file of the page: {path[:200]!r}", code="not_found")
    return Response(body, media_type=kind, headers=SECURITY_HEADERS)


@router.post("/ui/token")
async def ui_token(request: Request) -> JSONResponse:
    """A short-lived token that opens ``/ui/events`` (the guard checked the key, when there is one)."""
    tokens = request.app.state.stream_tokens
    key = get_deps(request).config.api.key() is not None
    return JSONResponse(
        {"token": tokens.issue(), "expires_in": int(tokens.ttl_s), "key_required": key},
        headers={"Cache-Control": "no-store"},
    )


@router.get("/ui/events")
async def ui_events(request: Request) -> Response:
    """Server-sent events: ``snapshot`` on connect, then ``update`` at most 10 times a second (docs/ui.md)."""
    feed = get_deps(request).ui
    if feed is None:
        return error_response(503, "this daemon has no live feed", code="feed_unavailable")
    return StreamingResponse(
        feed.stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
