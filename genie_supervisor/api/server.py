"""The FastAPI app factory and the uvicorn server that runs inside the daemon's task group.

    app = create_app(deps)                              # ApiDeps; routers read request.app.state.deps
    http = HttpServer(app, sock)                        # sock: a bound listening socket
    await tg.start(http.run)                            # ready once uvicorn accepts connections
    await http.stop(timeout=3)                          # graceful: stop accepting, drain, close

uvicorn's own signal handling is switched off: the supervisor owns SIGTERM/SIGINT/SIGHUP.
Errors use the OpenAI shape ``{"error": {"message", "type", "code"}}`` on every route.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import anyio
import uvicorn
from anyio.abc import TaskStatus
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import AdmissionError
from ..jsonlimits import MAX_DEPTH, JsonDepthError, check_depth

if TYPE_CHECKING:
    from .deps import ApiDeps


def error_body(
    status: int,
    message: str,
    type_: str | None = None,
    code: str | None = None,
    param: str | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}`` (plus `details`)."""
    if type_ is None:
        type_ = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **(details or {})}}


def error_response(
    status: int,
    message: str,
    type_: str | None = None,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    details: dict[str, Any] | None = None,
) -> JSONResponse:
    """An OpenAI-shaped error response."""
    return JSONResponse(error_body(status, message, type_, code, param, details), status_code=status, headers=headers)


def admission_response(exc: AdmissionError) -> JSONResponse:
    """The HTTP answer to an AdmissionError, read off the exception (a ``retry_after`` adds Retry-After;
    its `details`, e.g. a context overflow's ``n_prompt_tokens`` and ``n_ctx``, join the error object)."""
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return error_response(exc.status, str(exc), exc.error_type, exc.code, exc.param, headers, exc.details())


class BodyLimit:
    """ASGI middleware: bodies over `limit` bytes get 413, bodies nested deeper than `max_depth` 400.

    Both before any route sees them: every POST route takes JSON, and Python's parser (and
    pydantic) recurse once per level, so a body of 100,000 ``[`` would be a RecursionError.
    """

    def __init__(self, app: Any, limit: int, max_depth: int = MAX_DEPTH) -> None:
        self.app = app
        self.limit = limit
        self.max_depth = max_depth

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks = []
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            if len(body) > 262_144:  # a few ms per 100 KiB: keep big scans off the loop
                await anyio.to_thread.run_sync(check_depth, body, self.max_depth)
            else:
                check_depth(body, self.max_depth)
        except JsonDepthError as exc:
            await error_response(400, f"the body is {exc}", code="json_too_deep")(scope, receive, send)
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Any, receive: Any, send: Any) -> None:
        response = error_response(
            413, f"the request body is larger than {self.limit} bytes (api.max_body_bytes)", code="request_too_large"
        )
        await response(scope, receive, send)


def create_app(deps: ApiDeps) -> Any:
    """The app with the ops, OpenAI-compatible, Ollama, llama-server, management, control and web-page
    routes, serving `deps`."""
    from . import (
        control,
        llama_extra,
        llama_routes,
        manage,
        ollama_routes,
        openai_routes,
        ops,
        security,
        ui_routes,
    )

    app = FastAPI(title="genie-supervisor", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.deps = deps
    app.state.metrics_registry = None  # made by the first scrape (api.metrics.registry_of)
    app.state.stream_tokens = tokens = security.StreamTokens()

    async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", exc))
        return error_response(400, message, param=where or None)

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    async def admission_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, AdmissionError)
        return admission_response(exc)

    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        # a bug, not bad input: still JSON in the OpenAI shape (starlette logs the traceback)
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")

    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(AdmissionError, admission_error)
    app.add_exception_handler(Exception, internal_error)
    for routes in (ops, openai_routes, ollama_routes, llama_routes, llama_extra, manage, control, ui_routes):
        app.include_router(routes.router)
    return security.guard(BodyLimit(app, deps.config.api.max_body_bytes), deps.config, tokens)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6); OSError says why it could not bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers, telling us when it accepts connections."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = anyio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the supervisor owns the signals

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()


class HttpServer:
    """Runs an ASGI app with uvicorn on an already bound socket, inside the caller's task group."""

    def __init__(self, app: Any, sock: socket.socket, *, graceful_s: int = 2) -> None:
        self.sock = sock
        """The listening socket."""
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        """HOST:PORT it listens on (the real port when 0 was asked for)."""
        self.port: int = port
        """The port it listens on."""
        config = uvicorn.Config(
            app,
            log_config=None,
            lifespan="off",
            access_log=False,
            timeout_graceful_shutdown=graceful_s,
            server_header=False,
        )
        self._server = _Server(config)
        self._done: anyio.Event | None = None

    @property
    def serving(self) -> bool:
        """True once uvicorn accepts connections."""
        return self._server.started and not self._server.should_exit

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until stopped; ready once uvicorn accepts connections."""
        self._done = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._server.serve, [self.sock])
                await self._server.ready.wait()
                task_status.started()
        finally:
            self._done.set()
            self.sock.close()

    async def stop(self, timeout: float = 3.0) -> bool:  # noqa: ASYNC109 - a bounded drain
        """Stop accepting, let open requests finish (bounded); True if it stopped in time."""
        self._server.should_exit = True
        if self._done is None:
            return True
        with anyio.move_on_after(timeout):
            await self._done.wait()
        return self._done.is_set()
