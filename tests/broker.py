"""A real Mosquitto for the tests on a free loopback port (`Mosquitto`); the `broker` fixture of
tests/conftest.py runs one per test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import anyio
import anyio.abc
import pytest

from tests.net import HOST, free_port

MOSQUITTO = shutil.which("mosquitto") or next(
    (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None
)
"""The mosquitto binary, None where it is not installed."""
needs_broker = pytest.mark.skipif(MOSQUITTO is None, reason="the mosquitto binary is not installed")
"""Marks a test that starts a Mosquitto (skipped without the binary)."""


class Mosquitto:
    """A Mosquitto process on a fixed loopback port that can be stopped and started again."""

    def __init__(
        self, workdir: Path, *, persistence: bool = False, anonymous: bool = True, extra: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        self.conf = workdir / "mosquitto.conf"
        lines = [
            f"listener {self.port} {HOST}",
            *extra,
            f"allow_anonymous {str(anonymous).lower()}",
            f"persistence {str(persistence).lower()}",
        ]
        if os.geteuid() == 0:
            lines.append("user root")  # started as root it would switch users and lose the temp folder
        if persistence:
            lines.append(f"persistence_location {workdir}/")
        self.conf.write_text("\n".join(lines) + "\n")
        self.log = workdir / "mosquitto.log"
        self.proc: anyio.abc.Process | None = None

    async def start(self) -> None:
        """Start and wait (bounded) until the port accepts connections."""
        assert MOSQUITTO is not None
        with self.log.open("ab") as out:
            self.proc = await anyio.open_process(
                [MOSQUITTO, "-c", str(self.conf)], stdout=out, stderr=subprocess.STDOUT
            )
        with anyio.fail_after(10):
            while True:
                try:
                    stream = await anyio.connect_tcp(HOST, self.port)
                except OSError:
                    assert self.proc.returncode is None, self.log.read_text()
                    await anyio.sleep(0.02)  # readiness poll of a process we do not control
                    continue
                await stream.aclose()
                return

    async def stop(self) -> None:
        """SIGTERM and wait for the process to exit."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):
                await self.proc.wait()
        self.proc = None

    @property
    def url(self) -> str:
        """The broker's URL."""
        return f"mqtt://{HOST}:{self.port}"
