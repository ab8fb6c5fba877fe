"""Running one generation request: admission, model lease, engine, and the client's connection.

A route parses its body into a `Job` and returns ``GenerationResponse(deps, job)``, an ASGI
response that does the rest while it watches the client:

    admission slot (priority queue; 429 / 503)  ->  model lease (load / swap; 404 / 503)
      ->  backend.generate (context checked: 400)  ->  SSE chunks or one JSON body

Errors before the first byte become a JSON error with the right status; once streaming has
begun they become one SSE ``data: {"error": ...}`` event. A client that goes away (the ASGI
``http.disconnect`` message) cancels all of it: a queued request leaves the queue, a running
generation stops at its next step, and the slot and the lease are given back.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog
from starlette.responses import JSONResponse, Response

from engine import SamplingParams
from engine.errors import EngineError
from engine.tool_calls import ToolCall, ToolSyntax, content_prefix_len
from engine.tool_stream import CallDelta, CallStream

from ..errors import AdmissionError, EngineUnavailable
from ..events import RequestDone
from ..llm.serving import NO_EXTRAS, Piece, RequestExtras
from .schemas import check_token_ids
from .server import admission_response, error_body, error_response

if TYPE_CHECKING:
    from .deps import ApiDeps

log = structlog.get_logger(__name__)


@dataclass
class Result:
    """What a finished generation produced."""

    model: str
    """Model id that answered."""
    text: str = ""
    """The whole text."""
    finish_reason: str = "stop"
    """``stop``, ``length`` or ``cancelled``."""
    prompt_tokens: int = 0
    """Tokens in the prompt."""
    completion_tokens: int = 0
    """Tokens generated."""
    timings: dict[str, float] = field(default_factory=dict)
    """llama-server style timings."""
    tokens: list[int] = field(default_factory=list)
    """Generated token ids (where the backend says them)."""
    pieces: list[Piece] = field(default_factory=list)
    """The streamed pieces in order (token ids and log-probabilities with their text)."""
    content: str | None = None
    """With tools: the text without the tool calls (`ToolSyntax.parse`); None: the text is all content."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """The tool calls parsed from the text, each with its id (``call_...``)."""

    @property
    def message(self) -> str:
        """The answer's content: the text, less its tool calls."""
        return self.text if self.content is None else self.content


class Formatter(Protocol):
    """Turns a generation into one route's wire format."""

    def start(self, model: str) -> list[dict[str, Any]]: ...

    def piece(self, model: str, piece: Piece) -> dict[str, Any] | None:
        """A content event (None: the format keeps the text for `end`)."""
        ...

    def calls(self, model: str, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        """Streamed tool-call deltas as events (none for a format that sends its calls with `end`)."""
        ...

    def end(self, result: Result) -> list[dict[str, Any] | str]: ...

    def whole(self, result: Result) -> dict[str, Any]: ...


def _sse(event: dict[str, Any] | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass(frozen=True)
class Framing:
    """How a route frames a streamed answer and shapes its errors (default: SSE, OpenAI errors)."""

    media_type: str = "text/event-stream; charset=utf-8"
    """Content type of a streamed answer."""
    event: Callable[[dict[str, Any] | str], bytes] = _sse
    """One streamed event as bytes."""
    error: Callable[[int, str], dict[str, Any]] | None = None
    """The error body from (status, message), streamed or not; None: OpenAI's error object."""


SSE = Framing()
"""Server-sent events (the OpenAI and llama-server routes)."""


@dataclass
class Job:
    """One parsed generation request."""

    model: str | None
    """Model id or role asked for (None: the default)."""
    priority: str | None
    """Request class asked for (None: the policy's default)."""
    prompt: Any
    """Chat messages, text, or token ids."""
    sampling: SamplingParams
    """Sampling and stop rules."""
    stream: bool
    """Answer with server-sent events."""
    fmt: Formatter
    """The route's wire format."""
    prompt_param: str = "prompt"
    """The request field token ids came in (errors name ``prompt_param[i]``)."""
    extras: RequestExtras = NO_EXTRAS
    """Tools and constrained output."""
    framing: Framing = SSE
    """How the stream is framed and errors shaped (Ollama's NDJSON, for one)."""


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def _n_vocab(backend: Any) -> int | None:
    """The vocabulary size of a loaded backend's tokenizer (None where the backend does not say)."""
    tokenizer = getattr(backend, "tokenizer", None)
    tok = tokenizer() if callable(tokenizer) else None
    n = getattr(tok, "n_vocab", None)
    return n if isinstance(n, int) else None


def new_id(prefix: str) -> str:
    """An id like OpenAI's (``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class ToolSplitter:
    """A streamed answer while tool calls may follow: text is passed on as content up to where a call could
    start (`content_prefix_len`); the calls after it stream as the model writes them (`CallStream`, `deltas`);
    `finish` parses the whole text and sends what is left."""

    def __init__(self, syntax: ToolSyntax, parallel: bool) -> None:
        self.syntax = syntax
        self.parallel = parallel
        self.text = ""
        self.sent = 0
        """Characters of `text` passed on as content."""
        self._held: list[Piece] = []
        self._final = False
        self._longest = max((len(o) for o in syntax.openers), default=0)
        self._calls = CallStream(parallel)
        self._ids: list[str] = []

    def push(self, piece: Piece) -> Piece | None:
        """The content `piece` releases (None: nothing yet); its tokens go with the next released text."""
        self.text += piece.text
        self._held.append(piece)
        if self._final:
            return None
        cut = content_prefix_len(self.syntax, self.text)
        self._final = cut + self._longest < len(self.text)  # an opener is whole: nothing after it is content
        if cut <= self.sent:
            return None
        out = Piece(
            self.text[self.sent : cut],
            tuple(t for p in self._held for t in p.tokens),
            tuple(lp for p in self._held for lp in p.logprobs),
        )
        self.sent, self._held = cut, []
        return out

    def deltas(self) -> list[CallDelta]:
        """The tool-call deltas the text so far adds, each head with its call's id (none before content ends)."""
        return self._with_ids(self._calls.feed(self.text, self.sent)) if self._final else []

    def finish(self, result: Result) -> tuple[Piece | None, list[CallDelta]]:
        """Parse the whole text into `result` (content and calls with ids): the content not passed on yet and
        the call deltas not sent yet."""
        content, calls = self.syntax.parse(self.text)
        if not self.parallel:
            calls = calls[:1]
        indexed, deltas = self._calls.finish(calls)
        deltas = self._with_ids(deltas)
        result.content = content
        result.tool_calls = [replace(c, id=self._ids[k]) for k, c in indexed]
        sent = self.text[: self.sent]
        rest = content[len(sent) :] if content.startswith(sent) else ""
        if not rest:
            return None, deltas
        held = self._held
        return Piece(
            rest, tuple(t for p in held for t in p.tokens), tuple(lp for p in held for lp in p.logprobs)
        ), deltas

    def _with_ids(self, deltas: list[CallDelta]) -> list[CallDelta]:
        out = []
        for d in deltas:
            if d.name is not None:
                self._ids.append(f"call_{secrets.token_hex(12)}")
                d = replace(d, id=self._ids[d.index])
            out.append(d)
        return out


def _done(model: str, priority: str, r: Result, first_s: float | None) -> RequestDone:
    """The finished request as an observation (the web page's recent requests); ``tool_calls`` when calls were
    parsed from it, as the OpenAI routes answer."""
    tps = r.timings.get("predicted_per_second")
    return RequestDone(
        model=model,
        priority=priority,
        finish_reason="tool_calls" if r.tool_calls else r.finish_reason,
        prompt_tokens=r.prompt_tokens,
        completion_tokens=r.completion_tokens,
        first_token_ms=None if first_s is None else round(first_s * 1000.0, 1),
        decode_tps=round(float(tps), 2) if tps else None,
    )


class GenerationResponse(Response):
    """An ASGI response running `job` to the end, or until its client disconnects."""

    def __init__(self, deps: ApiDeps, job: Job) -> None:
        super().__init__()  # status, headers and body are decided while it runs
        self.deps = deps
        self.job = job
        self.started = False
        self.disconnected = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self.disconnected = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                await self._serve(scope, receive, send)
            finally:
                tg.cancel_scope.cancel()

    async def _serve(self, scope: Any, receive: Any, send: Any) -> None:
        deps, job = self.deps, self.job
        t0, first_s = time.monotonic(), None
        tail: tuple[Piece | None, list[CallDelta]] = (None, [])  # what ToolSplitter.finish left to send
        try:
            cls = deps.admission.resolve(job.priority)
            model = deps.models.resolve(job.model, fallback=True)
            async with deps.admission.slot(cls), deps.models.lease(model) as lease:
                if _token_ids(job.prompt):
                    check_token_ids(job.prompt, _n_vocab(lease.backend), job.prompt_param)
                stream = await lease.backend.generate(job.prompt, job.sampling, cls, job.extras)
                result = Result(model.id, prompt_tokens=stream.prompt_tokens)
                syntax = getattr(stream, "tool_syntax", None)
                splitter = ToolSplitter(syntax, stream.parallel_tool_calls) if syntax is not None else None
                try:
                    if job.stream:
                        await self._start_stream(send)
                        for first in job.fmt.start(model.id):
                            await self._send_event(send, first)
                    async for piece in stream:
                        if first_s is None and piece.text:
                            first_s = time.monotonic() - t0
                        result.text += piece.text
                        result.tokens.extend(piece.tokens)
                        result.pieces.append(piece)
                        out = piece if splitter is None else splitter.push(piece)
                        if job.stream and out is not None and (event := job.fmt.piece(model.id, out)) is not None:
                            await self._send_event(send, event)
                        if job.stream and splitter is not None:
                            for delta in job.fmt.calls(model.id, splitter.deltas()):
                                await self._send_event(send, delta)
                    if splitter is not None:  # the whole answer is in: its calls parsed before it is recorded
                        tail = splitter.finish(result)
                finally:
                    with anyio.CancelScope(shield=True):
                        await stream.aclose()
                        result.finish_reason = stream.finish_reason or "cancelled"
                        result.prompt_tokens = stream.prompt_tokens
                        result.completion_tokens = stream.completion_tokens
                        result.timings = stream.timings()
                        deps.models.record(_done(model.id, cls, result, first_s), result.timings)
            rest, deltas = tail
            if job.stream:
                if rest is not None and (content := job.fmt.piece(model.id, rest)) is not None:
                    await self._send_event(send, content)
                for end in [*job.fmt.calls(model.id, deltas), *job.fmt.end(result)]:
                    await self._send_event(send, end)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif result.finish_reason == "cancelled" and deps.models.closing:  # cut short by SIGTERM: retry later
                raise EngineUnavailable(
                    f"the supervisor is shutting down; the generation was stopped after "
                    f"{result.completion_tokens} tokens"
                )
            else:
                body = json.dumps(job.fmt.whole(result), ensure_ascii=False).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
        except AdmissionError as exc:
            await self._fail(scope, receive, send, exc.status, admission_response(exc), exc)
        except (ValueError, EngineError) as exc:  # an empty prompt, a template that cannot render it
            err = error_response(400, str(exc), code="invalid_request", param=getattr(exc, "param", None))
            await self._fail(scope, receive, send, 400, err, exc)
        except OSError:  # the client's socket went away while we wrote to it
            self.disconnected = True
        except Exception as exc:
            log.exception("request_failed", error=f"{type(exc).__name__}: {exc}")
            await self._fail(
                scope,
                receive,
                send,
                500,
                error_response(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"),
                exc,
            )

    async def _start_stream(self, send: Any) -> None:
        self.started = True
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", self.job.framing.media_type.encode()),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )

    async def _send_event(self, send: Any, event: dict[str, Any] | str) -> None:
        await send({"type": "http.response.body", "body": self.job.framing.event(event), "more_body": True})

    async def _fail(self, scope: Any, receive: Any, send: Any, status: int, response: Any, exc: BaseException) -> None:
        if self.disconnected:
            return
        log.info("request_error", status=status, error=str(exc))
        shape = self.job.framing.error
        try:
            if self.started:
                code = getattr(exc, "code", None)
                details = exc.details() if isinstance(exc, AdmissionError) else None
                body = (
                    error_body(status, str(exc), code=code, details=details)
                    if shape is None
                    else shape(status, str(exc))
                )
                await self._send_event(send, body)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                if shape is not None:  # the route's own error shape, the headers (Retry-After) kept
                    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
                    response = JSONResponse(shape(status, str(exc)), status_code=status, headers=headers)
                await response(scope, receive, send)
        except OSError:
            self.disconnected = True


def now_s() -> int:
    """Unix seconds (the ``created`` field)."""
    return int(time.time())
