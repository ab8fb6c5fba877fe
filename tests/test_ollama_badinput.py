"""Malformed bodies on the Ollama routes: each a 4xx with Ollama's {"error": "..."} naming the field, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from tests.apitools import make_api_supervisor, synth

pytestmark = pytest.mark.timeout(60)

HI = [{"role": "user", "content": "hi"}]
CHAT: dict[str, Any] = {"model": "tiny", "messages": HI, "stream": False, "options": {"num_predict": 2}}
GEN: dict[str, Any] = {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}

CASES = [
    ("/api/chat", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("/api/chat", {**CHAT, "messages": [{"role": "bot", "content": "hi"}]}, 400, "messages.0.role"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "images"),
    ("/api/chat", {**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, 400, "name"),
    ("/api/chat", {**CHAT, "tools": {"type": "function"}}, 400, "tools"),
    ("/api/chat", {**CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools[0].type"),
    ("/api/chat", {**CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "name"),
    ("/api/chat", {**CHAT, "format": 5}, 400, "format"),
    ("/api/chat", {**CHAT, "format": "yaml"}, 400, "format"),
    ("/api/chat", {**CHAT, "options": "hot"}, 400, "options"),
    ("/api/chat", {**CHAT, "options": {"num_predict": -5}}, 400, "options.num_predict"),
    ("/api/chat", {**CHAT, "options": {"temperature": "high"}}, 400, "options.temperature"),
    ("/api/chat", {**CHAT, "options": {"stop": ["x"] * 17}}, 400, "stop"),
    ("/api/chat", {**CHAT, "keep_alive": True}, 400, "keep_alive"),
    ("/api/chat", {**CHAT, "keep_alive": "later"}, 400, "keep_alive"),
    ("/api/chat", {**CHAT, "stream": "yes"}, 400, "stream"),
    ("/api/chat", {**CHAT, "think": True}, 400, "thinking"),
    ("/api/chat", {**CHAT, "model": None}, 400, "model"),
    ("/api/chat", {k: v for k, v in CHAT.items() if k != "model"}, 400, "model"),
    ("/api/chat", {**CHAT, "model": "nope"}, 404, "nope"),
    ("/api/chat", [CHAT], 400, "object"),
    ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "word " * 400}]}, 400, "context"),
    ("/api/generate", {**GEN, "prompt": 5}, 400, "prompt"),
    ("/api/generate", {**GEN, "suffix": "}"}, 400, "suffix"),
    ("/api/generate", {**GEN, "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {**GEN, "context": [1, 2, 3]}, 400, "context"),
    ("/api/generate", {**GEN, "images": ["aGk="]}, 400, "images"),
    ("/api/generate", {**GEN, "model": "nope:7b"}, 404, "nope:7b"),
    ("/api/show", {}, 400, "model"),
    ("/api/show", {"model": "nope"}, 404, "nope"),
    ("/api/pull", {"model": 5}, 400, "model"),
    ("/api/pull", {"name": "nope"}, 404, "cannot download"),
]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One daemon on a tiny synthetic model for every case (run by a thread of its own), and a client."""
    tmp_path = tmp_path_factory.mktemp("ollama-bad")
    body = f"models:\n  tiny: {{path: {synth(tmp_path, 'tiny')}, resident: true}}\napi: {{warmup: false}}\n"
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(portal.call(make_api_supervisor, tmp_path, body)) as sup,
    ):
        assert sup.http is not None
        with httpx.Client(base_url=f"http://127.0.0.1:{sup.http.port}", timeout=30) as client:
            yield client


@pytest.mark.parametrize(("route", "body", "status", "named"), CASES)
def test_malformed_bodies_get_a_4xx_naming_the_field(
    api: httpx.Client, route: str, body: Any, status: int, named: str
) -> None:
    """A malformed field is a 400 (an unknown model a 404) whose {"error": ...} string names it."""
    r = api.post(route, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error, str) and named in error


def test_the_same_bodies_are_served_when_well_formed(api: httpx.Client) -> None:
    """The base bodies the cases break are served (so each case fails for its own field)."""
    chat = api.post("/api/chat", json=CHAT)
    gen = api.post("/api/generate", json=GEN)
    assert chat.status_code == 200 and chat.json()["done"] is True
    assert gen.status_code == 200 and gen.json()["done"] is True
