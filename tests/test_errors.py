"""The request-error family: every class carries its HTTP answer, and the API answers with exactly it."""

from __future__ import annotations

from typing import Any, cast

import httpx
import pytest

from genie_supervisor import errors
from genie_supervisor.api import ApiDeps, create_app
from genie_supervisor.config import Config
from genie_supervisor.errors import (
    AdmissionError,
    BackendUnavailable,
    BadRequest,
    ContextTooLong,
    EngineUnavailable,
    LlmDisabled,
    ModelTooLarge,
    QueueFull,
    QueueTimeout,
    RequestRefused,
    UnknownModel,
    UnknownPriority,
    UpstreamContextTooLong,
    UpstreamError,
)

EXAMPLES: list[AdmissionError] = [
    AdmissionError("not now"),
    EngineUnavailable("no model is loaded"),
    RequestRefused("the policy refuses new requests (memory low)"),
    ContextTooLong(5000, 4096, "the model's context", 4900),
    QueueFull("the queue is full (8 waiting)", retry_after=2),
    QueueTimeout("waited longer than 30 s"),
    UnknownPriority("unknown priority 'urgent'"),
    BackendUnavailable("llama-server is not answering"),
    UpstreamError(418, "llama-server: I'm a teapot"),
    UpstreamError(503, "llama-server: loading"),
    UpstreamError(200, "llama-server answered an error with 200"),
    UpstreamContextTooLong("llama-server: request (600 tokens) exceeds the available context size (512)", 600, 512),
    UpstreamContextTooLong("llama-server: the request exceeds the available context size", None, None),
    UnknownModel("no model has the id or role 'nope'"),
    ModelTooLarge(900.0, 500.0, "model brain needs 900 MiB but the budget is 500 MiB"),
    LlmDisabled("the LLM is switched off"),
    BadRequest("n must be 1 (got 2): one choice per request", "n"),
    BadRequest("the body is not valid JSON"),
]
"""One or more instances of every class of the family (a new class needs a row here)."""


def _family(cls: type[AdmissionError]) -> set[type[AdmissionError]]:
    out = {cls}
    for sub in cls.__subclasses__():
        out |= _family(sub)
    return out


def _expected_type(status: int) -> str:
    """The OpenAI ``type`` the API has always derived from the status."""
    return "invalid_request_error" if status < 500 else "server_error"


def test_every_class_of_the_family_has_an_example_and_lives_in_errors() -> None:
    """The table covers the whole family, and every class of it is defined in genie_supervisor.errors."""
    family = _family(AdmissionError)
    assert {type(e) for e in EXAMPLES} == family
    assert len(family) >= 13
    assert all(cls.__module__ == errors.__name__ for cls in family)


@pytest.mark.parametrize("cls", sorted(_family(AdmissionError), key=str))
def test_every_class_carries_an_http_status_and_its_openai_type(cls: type[AdmissionError]) -> None:
    """Each class's status is 400..599, its code a word, and its type the one its status calls for."""
    assert 400 <= cls.status <= 599
    assert cls.code and cls.code.replace("_", "").isalpha()
    assert cls.error_type == _expected_type(cls.status)


class _Raises:
    """A fake admission and model manager: the first thing a route calls raises `exc`."""

    def __init__(self, exc: AdmissionError) -> None:
        self.exc = exc

    def resolve(self, _name: str | None, **_kw: Any) -> Any:
        raise self.exc

    async def unload(self, _model: str | None = None, *, force: bool = False) -> list[str]:
        raise self.exc


def _app(exc: AdmissionError) -> Any:
    fake = cast(Any, _Raises(exc))
    deps = ApiDeps(
        config=Config(),
        admission=fake,
        models=fake,
        gate=cast(Any, None),
        voice=cast(Any, None),
        policy=cast(Any, None),
        decision=lambda: None,
        status=dict,
        uptime_s=float,
        version="test",
    )
    return create_app(deps)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),  # the generation path
        ("/unload", {}),  # the app's exception handler
    ],
)
@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: f"{type(e).__name__}-{e.status}")
async def test_the_api_answers_each_error_with_its_status_and_a_json_body(
    exc: AdmissionError, path: str, body: dict[str, Any]
) -> None:
    """A route that meets an error of the family answers with the error's status and OpenAI JSON body."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app(exc)), base_url="http://127.0.0.1") as c:
        r = await c.post(path, json=body)
    assert 400 <= r.status_code <= 599
    assert r.status_code == exc.status
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {
        "error": {
            "message": str(exc),
            "type": _expected_type(exc.status),
            "param": exc.param,
            "code": exc.code,
            **exc.details(),
        }
    }
    assert r.headers.get("retry-after") == (str(exc.retry_after) if exc.retry_after is not None else None)


def test_upstream_error_passes_a_status_on_only_when_it_is_an_error() -> None:
    """llama-server's 4xx/5xx pass on with the matching type; anything else becomes 502."""
    assert (UpstreamError(429, "busy").status, UpstreamError(429, "busy").error_type) == (429, "invalid_request_error")
    assert (UpstreamError(200, "odd").status, UpstreamError(200, "odd").error_type) == (502, "server_error")
    assert QueueFull("full", 3).retry_after == 3 and AdmissionError("x").retry_after is None
