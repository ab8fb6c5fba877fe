"""The supervisor daemon under test: a subprocess with the Wyoming proxy in front of both servers.

One daemon serves all the runs of a benchmark; the scenario's policy is switched by rewriting the
policy file and sending SIGHUP (the daemon's documented reload), so whisper, Piper and the model
stay the same processes from run to run. The daemon's JSON log lines give the gate's pauses and
their reaction times per run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from .stack import HOST, VoiceStack, free_port, wait_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
POLICY_OFF = HERE / "policy-off.yaml"
"""Voice actions `none`: the contention run (the LLM decodes through STT and TTS)."""
POLICY_DEFAULT = ROOT / "policies" / "default.yaml"
"""The shipped default policy: the arbitration run."""


def wait_healthy(
    url: str,
    port: int,
    proc: subprocess.Popen[bytes],
    log_path: Path,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> None:
    """Wait until the daemon `proc` listens on `port` and its /health says ok; raise if it exits or times out."""
    wait_port(port, proc, "genie-supervisor", timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"genie-supervisor exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/health", headers=headers, timeout=2).json().get("status") == "ok":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"genie-supervisor not healthy within {timeout:.0f} s; see {log_path}")


@dataclass(frozen=True)
class ProxySettings:
    """The whisper proxy's hold of `audio-stop` (restart-only config, so fixed for a whole bench)."""

    hold_audio_stop_until_parked: bool = True
    """Hold the client's audio-stop until the engine is parked."""
    hold_max_ms: int = 250
    """The longest hold."""


def write_config(
    path: Path,
    stack: VoiceStack,
    *,
    model: Path,
    policy: Path,
    backend: str,
    threads: int | None,
    proxy: ProxySettings,
    max_running: int = 3,
) -> tuple[Path, int, int, int]:
    """A daemon config for the bench; returns (path, http port, STT proxy port, TTS proxy port)."""
    http, stt, tts = free_port(), free_port(), free_port()
    cfg: dict[str, Any] = {
        "log": {"level": "info", "format": "json"},
        "http": {"listen": f"{HOST}:{http}"},
        "engine": {"model": str(model), "backend": backend, "threads": threads},
        "policy": {"path": str(policy), "watch": False},
        "telemetry": {"platform": "linux", "interval_s": 1},
        # Room for the background clients and one voice turn at once (the default is 2).
        "api": {"max_running": max_running},
        "services": {
            "whisper": {
                "kind": "wyoming_stt",
                "match": {"pid_file": str(path.parent / "whisper.pid")},
                "proxy": {
                    "listen": f"{HOST}:{stt}",
                    "upstream": f"{HOST}:{stack.stt_port}",
                    "hold_audio_stop_until_parked": proxy.hold_audio_stop_until_parked,
                    "hold_max_ms": proxy.hold_max_ms,
                },
            },
            "piper": {
                "kind": "wyoming_tts",
                "match": {"pid_file": str(path.parent / "piper.pid")},
                "proxy": {
                    "listen": f"{HOST}:{tts}",
                    "upstream": f"{HOST}:{stack.tts_port}",
                    "hold_audio_stop_until_parked": False,
                    "hold_max_ms": 0,
                },
            },
        },
    }
    if not stack.tts_port:  # STT-only (the GPU bench): no Piper to watch or proxy
        del cfg["services"]["piper"]
        tts = 0
    for name in ("whisper", "piper"):
        pid = stack.pids.get(name)
        (path.parent / f"{name}.pid").write_text(f"{pid if pid else os.getpid()}\n")
    path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")  # JSON is YAML
    return path, http, stt, tts


class DaemonProcess:
    """`genie-supervisor run --config FILE` as a subprocess, its log in `log_path` (the benches' shared part)."""

    def __init__(
        self,
        config: Path,
        http_port: int,
        log_path: Path,
        headers: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.http_port = http_port
        self.url = f"http://{HOST}:{http_port}"
        self.log_path = log_path
        self.headers = headers or {}
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self, timeout: float = 120) -> None:  # noqa: ASYNC109
        """Start and wait until /health says ok (model loaded)."""
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in terminate()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "genie_supervisor", "run", "--config", str(self.config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, **self.env},
        )
        wait_healthy(self.url, self.http_port, self.proc, self.log_path, timeout, self.headers)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM (the daemon's graceful shutdown), SIGKILL after `grace_s`; closes the log; the exit status
        (None if it had to be killed)."""
        rc: int | None = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    rc = self.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            else:
                rc = self.proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc


class Daemon(DaemonProcess):
    """The voice bench's daemon: one policy file, switched by `use_policy`."""

    def __init__(self, config: Path, http_port: int, policy_file: Path, log_path: Path) -> None:
        super().__init__(config, http_port, log_path)
        self.policy_file = policy_file

    def use_policy(self, source: Path, timeout: float = 10) -> str:  # noqa: ASYNC109
        """Copy `source` into the daemon's policy file, SIGHUP, wait until it is in force; its name."""
        before = self.status()["policy"].get("generation", 0)
        self.policy_file.write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pol = self.status()["policy"]
            if pol.get("generation", 0) > before:
                if pol.get("error"):
                    raise RuntimeError(f"policy {source} rejected: {pol['error']}")
                return str(pol["name"])
            time.sleep(0.05)
        raise TimeoutError(f"policy {source} not reloaded within {timeout} s")

    def status(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/status", timeout=5).json())

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s; closes the log."""
        self.terminate(10)


def log_events(log_path: Path, t0_wall: float, t1_wall: float, names: set[str]) -> list[dict[str, Any]]:
    """Daemon JSON log lines named in `names` between two wall-clock times, each with `t` (epoch s)."""
    found: list[dict[str, Any]] = []
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") not in names or "timestamp" not in rec:
                continue
            t = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
            if t0_wall <= t <= t1_wall:
                rec["t"] = t
                found.append(rec)
    return found
