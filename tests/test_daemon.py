"""The daemon in-process and as a process: HTTP ops routes, policy errors and reload, systemd notify, signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from engine import ModelInfo
from genie_supervisor.errors import PolicyErrors
from tests.daemon import client, make_supervisor, wait_for, write_policy
from tests.lines import Lines as _Lines
from tests.models import SMOLLM2, require
from tests.net import free_port as _free_port

pytestmark = pytest.mark.timeout(60)

BAD_POLICY = "version: 1\nname: broken\nvoice:\n  stt: {action: throttle}\n"


async def test_health_and_status_answer(tmp_path: Path) -> None:
    """/health reports status, policy, gate and uptime; /status carries the whole snapshot."""
    policy = write_policy(tmp_path / "p.yaml", "first")
    with anyio.fail_after(20):
        async with make_supervisor(tmp_path, policy=policy) as sup, client(sup) as http:
            health = (await http.get("/health")).json()
            assert health["status"] == "ok" and health["policy"] == "first" and health["gate"] == "open"
            assert health["engine"] == "disabled" and health["model"] is None and health["uptime_s"] >= 0
            status = (await http.get("/status")).json()
            assert status["ready"] is True
            assert status["telemetry"]["platform"] == "simulated"
            assert status["policy"] == {"name": "first", "path": str(policy), "error": None, "generation": 1}
            assert status["decision"]["gate"] == "open"
            assert {"mode", "reasons", "reaction_ms_p99", "paused_seconds"} <= set(status["gate"])
            assert status["voice"]["stt_active"] is False


async def test_voice_event_route_pauses_gate_and_rejects_bad_input(tmp_path: Path) -> None:
    """POST /v1/voice/events start pauses the gate; malformed hints get a 400 OpenAI-shaped error."""
    with anyio.fail_after(20):
        async with make_supervisor(tmp_path, policy=write_policy(tmp_path / "p.yaml")) as sup, client(sup) as http:
            ok = await http.post("/v1/voice/events", json={"service": "stt", "event": "start"})
            assert ok.status_code == 200 and ok.json()["active"] is True
            await wait_for(sup, lambda: sup.gate.mode == "paused")
            assert sup.gate.reasons == {"stt"}
            for body in (b"not json", b'{"service": "stt", "event": "pause"}', b'{"service": "asr"}', b"[1]"):
                bad = await http.post("/v1/voice/events", content=body)
                assert bad.status_code == 400
                assert bad.json()["error"]["type"] == "invalid_request_error"
                assert bad.json()["error"]["message"]


async def test_bad_policy_at_start_is_a_clear_error(tmp_path: Path) -> None:
    """A policy file that does not validate stops the start with file:line key: message."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_POLICY, encoding="utf-8")
    with anyio.fail_after(20), pytest.raises(PolicyErrors) as info:
        async with make_supervisor(tmp_path, policy=bad):
            pass
    assert f"{bad}:4 voice.stt.throttle_tps: action throttle needs throttle_tps" in str(info.value)


async def test_reload_with_bad_file_keeps_old_policy(tmp_path: Path) -> None:
    """A reload picks up a good file; a bad one is rejected, the old policy stays, /status shows the error."""
    path = write_policy(tmp_path / "p.yaml", "first")
    with anyio.fail_after(20):
        async with make_supervisor(tmp_path, policy=path) as sup, client(sup) as http:
            write_policy(path, "second")
            assert await sup.reload_policy() is True
            assert (await http.get("/status")).json()["policy"]["name"] == "second"
            path.write_text(BAD_POLICY, encoding="utf-8")
            assert await sup.reload_policy() is False
            status = (await http.get("/status")).json()
            assert status["policy"]["name"] == "second"
            assert status["policy"]["error"].startswith(f"{path}:4 voice.stt.throttle_tps:")
            assert status["decision"]["policy"] == "second"
            assert (await http.get("/health")).json()["policy"] == "second"


class _StubModel:
    """Stands in for a loaded model where only load timing matters (the plan uses the real file)."""

    backend = "stub"

    def __init__(self, path: str) -> None:
        self.info = ModelInfo(
            name="stub", arch="llama", backend="stub", n_ctx=512, n_vocab=10, weights_bytes=1, kv_bytes=1, path=path
        )


async def test_notify_ready_waits_for_every_component(tmp_path: Path) -> None:
    """READY=1 only once every component (here a slow model load) has started; WATCHDOG=1 pings; STOPPING=1 at exit."""
    model = require(SMOLLM2)
    release = threading.Event()

    def slow_loader(path: str, **_: Any) -> Any:
        release.wait(10)
        return _StubModel(path)

    sock_path = str(tmp_path / "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(sock_path)
    listener.settimeout(5)
    received: list[str] = []

    async def recv_until(word: str) -> None:
        while not any(word in m for m in received):
            received.append((await anyio.to_thread.run_sync(listener.recv, 4096)).decode())

    env = {"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "100000"}
    sup = make_supervisor(
        tmp_path, policy=write_policy(tmp_path / "p.yaml"), model=model, environ=env, model_loader=slow_loader
    )
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sup.run)
                await recv_until("STATUS=starting")
                await wait_for(sup, lambda: sup.http is not None and sup.http.serving and sup.engine.state == "loading")
                async with client(sup) as http:  # HTTP is up while the model loads ...
                    assert (await http.get("/health")).json()["status"] == "loading"
                assert not any("READY=1" in m for m in received)  # ... but READY waits for it
                release.set()
                await recv_until("READY=1")
                assert sup.ready and sup.engine.state == "idle"
                assert sup.store.snapshot().telemetry is not None
                ready_at = next(i for i, m in enumerate(received) if "READY=1" in m)
                received.clear()
                await recv_until("WATCHDOG=1")
                assert ready_at >= 1
                sup.request_stop("test")
                await recv_until("STOPPING=1")
    finally:
        release.set()
        listener.close()


def _run(args: list[str], tmp_path: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    return subprocess.Popen(
        [sys.executable, "-m", "genie_supervisor", "run", *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_run_subprocess_sighup_reload_and_sigterm_exit(tmp_path: Path) -> None:
    """`genie-supervisor run` reloads on SIGHUP (keeping the old policy on a bad file) and exits 0 within 5 s of SIGTERM."""
    policy = write_policy(tmp_path / "p.yaml", "first")
    args = ["--policy", str(policy), "--platform", "simulated", "--listen", f"127.0.0.1:{_free_port()}"]
    if SMOLLM2.exists():
        args += ["--model", str(SMOLLM2)]
    with _run(args, tmp_path) as proc:
        out = _Lines(proc)
        try:
            out.wait_for('"supervisor_ready"', 40)
            policy.write_text(BAD_POLICY, encoding="utf-8")
            proc.send_signal(signal.SIGHUP)
            assert "voice.stt.throttle_tps" in out.wait_for('"policy_rejected"', 10)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=5)
            elapsed = time.monotonic() - t0
            out.wait_for('"supervisor_stopped"', 1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.thread.join(5)
        stderr = proc.stderr.read() if proc.stderr else ""
    assert rc == 0 and elapsed < 5.0, (rc, elapsed, stderr)


def test_run_subprocess_bad_policy_exits_1_with_file_line(tmp_path: Path) -> None:
    """`genie-supervisor run` with an invalid policy prints file:line key: message and exits 1."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_POLICY, encoding="utf-8")
    with _run(
        ["--policy", str(bad), "--platform", "simulated", "--listen", f"127.0.0.1:{_free_port()}"], tmp_path
    ) as proc:
        try:
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 1
    assert f"{bad}:4 voice.stt.throttle_tps: action throttle needs throttle_tps" in err
