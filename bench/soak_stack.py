"""What the soak runs against: Mosquitto and the real daemon (subprocess) with two models in one swap group.

    broker = Mosquitto(workdir)                    # free loopback port, anonymous, loopback only
    files = write_files(workdir, broker.port, smollm2=..., gemma3=...)
    daemon = Daemon(files, log_path); daemon.start()
    ...
    daemon.stop(); broker.stop()

The policy folder holds two valid files: `soak.yaml` (the one in force, rewritten by the soak's
reload operations) and `soak-alt.yaml` (what the MQTT policy select switches to and back from).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.voice_path.daemon import DaemonProcess
from bench.voice_path.stack import HOST, free_port, wait_port

ROOT = Path(__file__).resolve().parents[1]
NODE = "soak"
"""The daemon's node_id: its MQTT topics are genie/soak/..."""

POLICY = """\
version: 1
name: {name}
voice:
  stt: {{action: pause, resume_holdoff_ms: {holdoff_ms}}}
  tts: {{action: none}}
  prefill_chunk_tokens: {chunk}
thermal:
  sensor: cpu
  levels:
    - {{name: warm, enter_c: 95, leave_c: 90, action: throttle, throttle_tps: 10}}
    - {{name: hot, enter_c: 105, leave_c: 100, action: pause}}
failsafe: {{telemetry_unknown: ignore}}
"""
"""A valid policy: STT pauses decode (with a hold-off), thermal levels above what a dev box reaches."""

POLICY_VARIANTS = (
    POLICY.format(name="soak-a", holdoff_ms=200, chunk=64),
    POLICY.format(name="soak-b", holdoff_ms=350, chunk=128) + "# variant b\n",
)
"""The two valid variants the reload operation alternates (different names and sizes)."""
POLICY_ALT = POLICY.format(name="soak-alt", holdoff_ms=250, chunk=64)
POLICY_INVALID = "version: 1\nname: soak-broken\nvoice:\n  stt: {action: explode}\n"
"""Rejected by validation (unknown action): the daemon must keep the policy in force."""

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None
)


class Mosquitto:
    """Mosquitto on a free loopback port (anonymous, loopback only), its log in the work folder."""

    def __init__(self, workdir: Path) -> None:
        if MOSQUITTO is None:
            raise RuntimeError("the mosquitto binary is not installed (apt install mosquitto)")
        self.port = free_port()
        conf = workdir / "mosquitto.conf"
        lines = [f"listener {self.port} {HOST}", "allow_anonymous true"]
        if os.geteuid() == 0:
            lines.append("user root")
        conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
        self._log = open(workdir / "mosquitto.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=self._log, stderr=subprocess.STDOUT)
        wait_port(self.port, self.proc, "mosquitto", 10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@dataclass(frozen=True)
class SoakFiles:
    """The generated config and policy files and the daemon's HTTP port."""

    config: Path
    """The daemon config (JSON, which is YAML)."""
    policy: Path
    """The policy file in force at start (`soak.yaml`)."""
    policy_alt: Path
    """The other selectable policy file (`soak-alt.yaml`)."""
    http_port: int
    """Where the API listens (loopback)."""
    mqtt_port: int
    """Where the broker listens (loopback)."""


def write_files(
    workdir: Path,
    mqtt_port: int,
    *,
    smollm2: Path,
    gemma3: Path,
    threads: int | None,
    api_key: str | None,
    max_running: int,
) -> SoakFiles:
    """Config with both models in swap group `small`, policy folder with two valid files."""
    pol_dir = workdir / "policies"
    pol_dir.mkdir(parents=True, exist_ok=True)
    policy, alt = pol_dir / "soak.yaml", pol_dir / "soak-alt.yaml"
    policy.write_text(POLICY_VARIANTS[0], encoding="utf-8")
    alt.write_text(POLICY_ALT, encoding="utf-8")
    http = free_port()
    api: dict[str, Any] = {"max_running": max_running, "warmup": False}
    if api_key is not None:  # only when asked for: a daemon without the key setting would refuse it
        api["api_key"] = api_key
    cfg = {
        "node_id": NODE,
        "log": {"level": "info", "format": "json"},
        "http": {"listen": f"{HOST}:{http}"},
        "mqtt": {"url": f"mqtt://{HOST}:{mqtt_port}", "publish_interval_s": 5, "startup_wait_s": 5},
        "engine": {"backend": "auto", "threads": threads},
        "models": {
            "smollm2": {"path": str(smollm2), "roles": ["default"], "group": "small"},
            "gemma3": {"path": str(gemma3), "group": "small"},
        },
        "policy": {"path": str(policy), "watch": True, "poll_interval_s": 0.5},
        "telemetry": {"platform": "linux", "interval_s": 1},
        "api": api,
    }
    config = workdir / "supervisor.yaml"
    config.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return SoakFiles(config, policy, alt, http, mqtt_port)


class Daemon(DaemonProcess):
    """`genie-supervisor run --config FILE` as a subprocess, its log (JSON lines) in `log_path`."""

    def __init__(
        self, files: SoakFiles, log_path: Path, headers: dict[str, str], env: dict[str, str] | None = None
    ) -> None:
        super().__init__(files.config, files.http_port, log_path, headers, env)
        self.files = files

    def check_alive(self) -> None:
        """Raise when the daemon has exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"genie-supervisor exited ({self.proc.returncode}); see {self.log_path}")

    def sighup(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> int | None:
        """SIGTERM (graceful), SIGKILL after 15 s; the exit status (None if it had to be killed)."""
        return self.terminate(15)


def log_problems(log_path: Path) -> dict[str, Any]:
    """Counts of the daemon's error/critical log lines by event, and lines that are not JSON (tracebacks)."""
    by_event: dict[str, int] = {}
    not_json = 0
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                not_json += bool(line.strip())
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                not_json += 1
                continue
            if rec.get("level") in ("error", "critical", "exception"):
                key = str(rec.get("event"))
                by_event[key] = by_event.get(key, 0) + 1
    return {"errors_by_event": by_event, "non_json_lines": not_json}
