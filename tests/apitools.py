"""Helpers of the API tests: tiny synthetic models, multi-model configs, SSE reading, the openai client, a fake
llama-server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
from anyio.abc import Process

from engine.synth import write_synthetic_gguf
from genie_supervisor.api.server import bind_socket
from genie_supervisor.app import Supervisor
from genie_supervisor.config import load_config
from genie_supervisor.telemetry import SimulatedSource

SHAPES: dict[str, dict[str, int]] = {
    "small": dict(n_layers=1, n_embd=64, n_ff=128, n_heads=4, n_kv_heads=2, n_vocab=512),  # ~0.9 MiB at n_ctx 256
    "mid": dict(n_layers=2, n_embd=128, n_ff=256, n_heads=4, n_kv_heads=2, n_vocab=512),  # ~2.4 MiB
    "big": dict(n_layers=4, n_embd=256, n_ff=768, n_heads=4, n_kv_heads=2, n_vocab=512),  # ~14.9 MiB
}

POLICY = """\
version: 1
name: api-test
voice:
  stt: {{action: pause, resume_holdoff_ms: 0}}
  tts: {{action: none}}
  prefill_chunk_tokens: 16
memory: {{llm_budget_mb: {budget}}}
priorities:
  classes:
    - {{name: voice, max_queue: 4, max_wait_s: {wait}}}
    - {{name: tool, max_queue: 16, max_wait_s: {wait}}}
    - {{name: background, max_queue: 16, max_wait_s: {wait}}}
  default_class: background
failsafe: {{telemetry_unknown: ignore}}
"""


def synth(tmp_path: Path, name: str, shape: str = "small", seed: int = 0) -> Path:
    """A tiny random llama model (valid tokenizer and template) at tmp_path/name.gguf."""
    path = tmp_path / f"{name}.gguf"
    write_synthetic_gguf(path, "llama", seed=seed, name=name, **SHAPES[shape])
    return path


def make_api_supervisor(
    tmp_path: Path, body: str, *, budget: float = 1024, wait_s: float = 30, model_loader: Any = None
) -> Supervisor:
    """A Supervisor on a free port with `body` (YAML: models, api, backend, ...) and a test policy."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(budget=budget, wait=wait_s), encoding="utf-8")
    cfg_path = tmp_path / "supervisor.yaml"
    cfg_path.write_text(
        "\n".join(
            [
                "telemetry: {platform: simulated, interval_s: 0.05}",
                f"policy: {{path: {policy}, watch: false}}",
                "engine: {backend: numpy, n_ctx: 256}",
                body,
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    return Supervisor(
        load_config(cfg_path),
        telemetry_source=SimulatedSource(),
        http_socket=bind_socket("127.0.0.1", 0),
        environ={},
        model_loader=model_loader,
    )


def oai(sup: Supervisor) -> openai.AsyncOpenAI:
    """The official client against the daemon (no retries: 429/503 are what tests look at)."""
    assert sup.http is not None
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sup.http.port}/v1", api_key="x", max_retries=0, timeout=60)


def http(sup: Supervisor, timeout: float = 30) -> httpx.AsyncClient:
    """A plain HTTP client against the daemon."""
    assert sup.http is not None
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{sup.http.port}", timeout=timeout)


def sse_data(lines: list[str]) -> list[Any]:
    """The JSON objects of ``data:`` lines (``[DONE]`` kept as the string)."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


FAKE_LLAMA = Path(__file__).with_name("fake_llama_server.py")
"""The fake llama-server script (`tests.fake_llama_server`)."""

LLAMA_CPP_CONFIG = """\
backend: llama_cpp
llama_cpp: {{url: "http://127.0.0.1:{port}"}}
models:
  remote: {{roles: [default], resident: true, n_ctx: 512}}
api: {{warmup: false}}
"""
"""A daemon config serving the fake llama-server's model ``remote`` on `port` through the llama_cpp backend."""


@asynccontextmanager
async def fake_llama_server(*args: str) -> AsyncIterator[tuple[int, Process]]:
    """The fake llama-server (alias ``remote``, more `args`) on a free loopback port, once it answers /health:
    its port and process (terminated on exit)."""
    with bind_socket("127.0.0.1", 0) as s:
        port = s.getsockname()[1]
    argv = [sys.executable, str(FAKE_LLAMA), "--port", str(port), "--alias", "remote", *args]
    async with await anyio.open_process(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        try:
            with anyio.fail_after(60):
                async with httpx.AsyncClient() as probe:
                    while True:  # waiting for another process to listen: polled, bounded
                        try:
                            if (await probe.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                                break
                        except httpx.HTTPError:
                            await anyio.sleep(0.1)
            yield port, proc
        finally:
            proc.terminate()
