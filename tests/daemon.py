"""Helpers to run the daemon in-process: config files, a Supervisor on a free port, waits on state."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

from genie_supervisor.api.server import bind_socket
from genie_supervisor.app import Supervisor
from genie_supervisor.config import load_config
from genie_supervisor.telemetry import SimulatedSource

POLICY = """\
version: 1
name: {name}
voice:
  stt: {{action: pause, resume_holdoff_ms: {holdoff_ms}}}
  tts: {{action: none}}
  prefill_chunk_tokens: 16
thermal:
  sensor: cpu
  levels:
    - {{name: warm, enter_c: 80, leave_c: 70, action: throttle, throttle_tps: {cap}}}
    - {{name: hot, enter_c: 95, leave_c: 90, action: pause}}
failsafe: {{telemetry_unknown: ignore}}
"""

TINY_ENGINE = "backend: numpy, n_ctx: 256"
"""`write_config`'s engine keys for the tiny synthetic models: NumPy, a 256-token context."""


def write_policy(path: Path, name: str = "test-policy", *, holdoff_ms: int = 300, cap: float = 10) -> Path:
    """A valid policy file: STT pauses (with hold-off), warm throttles to `cap`, hot pauses."""
    path.write_text(POLICY.format(name=name, holdoff_ms=holdoff_ms, cap=cap), encoding="utf-8")
    return path


def write_config(
    path: Path,
    policy: Path | None,
    *,
    model: Path | None = None,
    engine: str = "backend: auto",
    extra: str = "",
    warmup: bool = False,
) -> Path:
    """A daemon config for tests: simulated platform sampled every 50 ms, policy not polled, no warm-up;
    `engine` is the engine section's keys after the model, `extra` more top-level YAML."""
    lines = [
        "telemetry: {platform: simulated, interval_s: 0.05}",
        f"policy: {{path: {str(policy) if policy else 'null'}, watch: false}}",
        f"engine: {{model: {str(model) if model else 'null'}, {engine}}}",
        "" if warmup or "api:" in extra else "api: {warmup: false}",
        extra,
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def make_supervisor(
    tmp_path: Path,
    *,
    policy: Path | None = None,
    model: Path | None = None,
    source: SimulatedSource | None = None,
    engine: str = "backend: auto",
    extra: str = "",
    **kwargs: Any,
) -> Supervisor:
    """A Supervisor on a free loopback port with a simulated platform, on `write_config`'s file (fakes via
    `kwargs`)."""
    cfg = load_config(write_config(tmp_path / "supervisor.yaml", policy, model=model, engine=engine, extra=extra))
    return Supervisor(
        cfg,
        telemetry_source=source or SimulatedSource(),
        http_socket=bind_socket("127.0.0.1", 0),
        environ=kwargs.pop("environ", {}),
        **kwargs,
    )


def client(sup: Supervisor) -> httpx.AsyncClient:
    """An HTTP client for the supervisor's API."""
    assert sup.http is not None
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{sup.http.port}", timeout=10)


async def wait_for(sup: Supervisor, predicate: Callable[[], bool], timeout: float = 15) -> None:  # noqa: ASYNC109
    """Wait (bounded) until `predicate()` holds, re-checking on every change of the state store."""
    with anyio.fail_after(timeout):
        while not predicate():
            await sup.store.wait_changed(sup.store.version)
