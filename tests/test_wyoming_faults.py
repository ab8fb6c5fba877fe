"""Faults around the Wyoming proxy with real processes: whisper killed mid-transcription."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream
from wyoming.client import AsyncTcpClient

from genie_supervisor.api.server import bind_socket
from genie_supervisor.app import Supervisor
from genie_supervisor.config import load_config
from genie_supervisor.telemetry import SimulatedSource
from tests.daemon import wait_for, write_config, write_policy
from tests.test_wyoming_proxy import HOST, client_exchange, free_port, stt_request

ROOT = Path(__file__).resolve().parent.parent


class AsrProcess:
    """tests/wyoming_asr_server.py in its own process; `lines` receives what it prints."""

    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._lines = TextReceiveStream(process.stdout)
        self._buffer = ""

    async def wait_line(self, wanted: str, within_s: float = 20) -> None:
        """Read its output until the line `wanted` appears."""
        with anyio.fail_after(within_s):
            while True:
                lines = self._buffer.split("\n")
                if wanted in lines[:-1]:
                    self._buffer = "\n".join(lines[lines.index(wanted) + 1 :])
                    return
                self._buffer += await self._lines.receive()


@asynccontextmanager
async def asr_server(port: int) -> AsyncIterator[AsrProcess]:
    """Start the server on `port`, wait for `ready`; SIGKILL it on exit if it still runs."""
    process = await anyio.open_process(
        [sys.executable, "-m", "tests.wyoming_asr_server", str(port)], cwd=ROOT, stderr=subprocess.DEVNULL
    )
    try:
        server = AsrProcess(process)
        await server.wait_line("ready")
        yield server
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.move_on_after(10):
            await process.wait()
        await process.aclose()


@pytest.mark.timeout(90)
async def test_whisper_killed_mid_transcription(tmp_path: Path) -> None:
    """SIGKILL of the whisper process after audio-start and some chunks: the client gets a clean
    close, STT is no longer active and the gate opens, the service is down; up again on restart."""
    upstream, listen = free_port(), free_port()
    extra = (
        "services:\n"
        "  whisper:\n"
        "    kind: wyoming_stt\n"
        f"    proxy: {{listen: '{HOST}:{listen}', upstream: '{HOST}:{upstream}',"
        " health_interval_s: 0.2, hold_max_ms: 100}\n"
    )
    cfg = load_config(
        write_config(tmp_path / "supervisor.yaml", write_policy(tmp_path / "p.yaml", holdoff_ms=0), extra=extra)
    )
    sup = Supervisor(cfg, telemetry_source=SimulatedSource(), http_socket=bind_socket("127.0.0.1", 0), environ={})

    def whisper_up() -> bool | None:
        obs = sup.store.snapshot().services.get("whisper")
        return None if obs is None else obs.up

    async with sup:
        async with asr_server(upstream) as server:
            await wait_for(sup, lambda: whisper_up() is True)
            async with AsyncTcpClient(HOST, listen) as client:
                for event in stt_request(3)[:-1]:  # transcribe, audio-start, 3 chunks; no audio-stop
                    await client.write_event(event)
                for _ in range(3):
                    await server.wait_line("event audio-chunk")
                await wait_for(sup, lambda: sup.store.snapshot().voice.stt_active and sup.gate.mode == "paused")
                server.process.send_signal(signal.SIGKILL)
                with anyio.fail_after(10):
                    assert await client.read_event() is None  # EOF: not a reset, not a hang
            await wait_for(sup, lambda: whisper_up() is False)
            await wait_for(sup, lambda: not sup.store.snapshot().voice.stt_active and sup.gate.mode != "paused")
            down = sup.store.snapshot().services["whisper"]
            assert "mid-request" in down.reason or "connect failed" in down.reason, down.reason

        async with asr_server(upstream):
            await wait_for(sup, lambda: whisper_up() is True)
            assert sup.store.snapshot().services["whisper"].restarts >= 1
            answer = await client_exchange(listen, stt_request(1))
            assert [e.type for e in answer] == ["transcript"]
