"""Module-scoped fixtures of the API tests that run many short generations on SmolLM2: the model (one CPU
thread), the daemon serving it from a thread of its own, the official openai client and a plain HTTP client.

Import them into a test module (``from tests.serving_daemon import api, daemon, model, oa``); `threaded_daemon` runs
another daemon the same way."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio.from_thread
import httpx
import openai
import pytest

from engine import Model, load_model
from genie_supervisor.api.server import bind_socket
from genie_supervisor.app import Supervisor
from genie_supervisor.config import load_config
from genie_supervisor.telemetry import SimulatedSource
from tests.daemon import write_config, write_policy
from tests.models import SMOLLM2, require


@pytest.fixture(scope="module")
def model() -> Model:
    """SmolLM2 on the CPU with one thread (the native kernels' thread pool slows down tenfold when the cores are
    busy, and these tests run many short generations)."""
    return load_model(require(SMOLLM2), threads=1)


@contextmanager
def threaded_daemon(cfg: Path, port: int = 0, **kwargs: Any) -> Iterator[Supervisor]:
    """The daemon of config file `cfg` (simulated telemetry, loopback `port` or a free one, more Supervisor
    `kwargs`), run by a thread of its own until the block ends."""

    def build() -> Supervisor:
        return Supervisor(
            load_config(cfg),
            telemetry_source=SimulatedSource(),
            http_socket=bind_socket("127.0.0.1", port),
            environ={},
            **kwargs,
        )

    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(portal.call(build)) as sup,
    ):
        yield sup


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, model: Model) -> Iterator[Supervisor]:
    """The daemon serving `model`, run by a thread of its own."""
    tmp = tmp_path_factory.mktemp("serving")
    cfg = write_config(tmp / "supervisor.yaml", write_policy(tmp / "p.yaml"), model=SMOLLM2)
    with threaded_daemon(cfg, model_loader=lambda *_a, **_k: model) as sup:
        yield sup


@pytest.fixture(scope="module")
def oa(daemon: Supervisor) -> Iterator[openai.OpenAI]:
    """The official client against the daemon (no retries)."""
    assert daemon.http is not None
    base = f"http://127.0.0.1:{daemon.http.port}/v1"
    with openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def api(daemon: Supervisor) -> Iterator[httpx.Client]:
    """A plain HTTP client against the daemon."""
    assert daemon.http is not None
    with httpx.Client(base_url=f"http://127.0.0.1:{daemon.http.port}", timeout=120) as client:
        yield client
