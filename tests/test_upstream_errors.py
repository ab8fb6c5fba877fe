"""Upstream servers that answer badly (a broken error body, odd JSON) give the forwarding backends a clear
error or state, never a bare exception that would be a 500 or stop the model manager's health loop."""

from __future__ import annotations

import socket
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import SamplingParams
from genie_supervisor.arbiter import Arbiter, DecodeGate
from genie_supervisor.config import Config, load_config
from genie_supervisor.errors import UpstreamError
from genie_supervisor.llm.llama_cpp import LlamaCppBackend
from genie_supervisor.llm.remote import OpenAIBackend
from genie_supervisor.llm.serving import BackendContext

pytestmark = pytest.mark.timeout(30)

HI = [{"role": "user", "content": "hi"}]
BROKEN_500 = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    b'{"error": {"message": "out of mem'
)
"""A 500 whose body stops short of its Content-Length (the server died while answering)."""


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


class CannedServer:
    """A loopback HTTP/1.1 server answering each path with fixed bytes, one request per connection."""

    def __init__(self, answers: dict[str, bytes]) -> None:
        self.answers = answers
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(body) < length:  # read the whole request, so closing sends no reset
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                path = head.split(b" ")[1].decode() if head.count(b" ") >= 2 else ""
                conn.sendall(self.answers.get(path, b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
                conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Stop accepting (shutting the socket down wakes the blocked accept)."""
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


@pytest.fixture
def canned() -> Iterator[dict[str, bytes]]:
    """The answers of a `CannedServer` (fill them in), its base URL under the key ``url``."""
    answers: dict[str, bytes] = {}
    server = CannedServer(answers)
    answers["url"] = server.url.encode()
    yield answers
    server.close()


def _context(tmp_path: Path, text: str) -> tuple[Config, BackendContext]:
    path = tmp_path / "supervisor.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    cfg = load_config(path)
    gate = DecodeGate()
    return cfg, BackendContext(cfg, gate, Arbiter(gate), lambda _obs: None)


def _openai(tmp_path: Path, url: str) -> OpenAIBackend:
    cfg, ctx = _context(tmp_path, f"openai: {{url: '{url}/v1'}}\nmodels:\n  big: {{backend: openai}}\n")
    return OpenAIBackend("big", cfg.models["big"], ctx)


async def test_openai_remote_error_body_that_breaks_off_is_a_502(tmp_path: Path, canned: dict[str, bytes]) -> None:
    """A remote 500 whose body breaks off is a 502 naming the remote, and the backend still answers after it."""
    canned["/v1/models"] = _ok(b'{"data": [{"id": "big"}]}')
    canned["/v1/chat/completions"] = BROKEN_500
    backend = _openai(tmp_path, canned["url"].decode())
    await backend.load()
    try:
        with pytest.raises(UpstreamError) as info:
            await backend.generate(HI, SamplingParams(max_tokens=4), None)
        assert info.value.status == 502 and backend.who in str(info.value) and "500" in str(info.value)
        assert await backend.check() is None and backend.reachable is True
    finally:
        await backend.unload()


async def test_openai_probe_of_a_models_list_that_is_not_a_list(tmp_path: Path, canned: dict[str, bytes]) -> None:
    """A remote whose /models answers 200 with ``data`` that is no list is up, listing nothing (the health
    loop goes on)."""
    canned["/v1/models"] = _ok(b'{"data": 5}')
    backend = _openai(tmp_path, canned["url"].decode())
    await backend.load()
    try:
        assert await backend.check() is None
        assert backend.reachable is True and backend.listed == []
    finally:
        await backend.unload()


async def test_llama_server_error_body_that_breaks_off_is_a_502(tmp_path: Path, canned: dict[str, bytes]) -> None:
    """An attached llama-server's 500 whose body breaks off is a 502 naming llama-server."""
    canned["/health"] = _ok(b'{"status": "ok"}')
    canned["/v1/chat/completions"] = BROKEN_500
    url = canned["url"].decode()
    cfg, ctx = _context(tmp_path, f"llama_cpp: {{url: '{url}'}}\nmodels:\n  brain: {{backend: llama_cpp}}\n")
    backend = LlamaCppBackend("brain", cfg.models["brain"], ctx)
    await backend.load()
    try:
        with pytest.raises(UpstreamError) as info:
            await backend.generate(HI, SamplingParams(max_tokens=4), None)
        assert info.value.status == 502 and "llama-server" in str(info.value)
    finally:
        await backend.unload()
