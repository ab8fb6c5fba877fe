"""The Wyoming proxy in the daemon with the real engine: STT through the proxy parks decode first."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from wyoming.client import AsyncTcpClient

from genie_supervisor.api.server import bind_socket
from genie_supervisor.app import Supervisor
from genie_supervisor.config import load_config
from genie_supervisor.telemetry import SimulatedSource
from tests.awaitlog import Log
from tests.daemon import write_config, write_policy
from tests.models import SMOLLM2, require, shared_model
from tests.test_gate_engine import PROMPT, Consumer, greedy
from tests.test_wyoming_proxy import HOST, FakeServer, free_port, stt_request

pytestmark = pytest.mark.timeout(300)
HOLDOFF_MS = 300


class _Order(Log):
    """The fake whisper's event log; notes whether the engine was parked when audio-stop arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.sup: Supervisor | None = None
        self.parked_at_audio_stop: bool | None = None

    def __call__(self, item: Any) -> None:
        if item == "server:audio-stop" and self.sup is not None:
            self.parked_at_audio_stop = self.sup.gate.parked
        super().__call__(item)


async def test_stt_through_the_proxy_parks_decode_before_audio_stop_and_resumes_after_holdoff(
    tmp_path: Path,
) -> None:
    """A streaming generation is parked before whisper sees audio-stop, produces nothing until the
    transcript plus hold-off, and then finishes with the same greedy text as an undisturbed run."""
    model = shared_model(require(SMOLLM2))
    upstream, listen = free_port(), free_port()
    order = _Order()
    server = await FakeServer(upstream, order=order, delay_s=0.3).start()
    extra = (
        "services:\n"
        "  whisper:\n"
        "    kind: wyoming_stt\n"
        f"    proxy: {{listen: '{HOST}:{listen}', upstream: '{HOST}:{upstream}',"
        " hold_audio_stop_until_parked: true, hold_max_ms: 5000}\n"
    )
    cfg = load_config(
        write_config(
            tmp_path / "supervisor.yaml",
            write_policy(tmp_path / "p.yaml", holdoff_ms=HOLDOFF_MS),
            model=SMOLLM2,
            extra=extra,
        )
    )
    sup = Supervisor(
        cfg,
        telemetry_source=SimulatedSource(),
        http_socket=bind_socket("127.0.0.1", 0),
        environ={},
        model_loader=lambda *_a, **_k: model,
    )
    order.sup = sup
    try:
        async with sup, anyio.create_task_group() as tg:
            ref = await (await sup.engine.generate(PROMPT, greedy())).collect()
            c = Consumer(await sup.engine.generate(PROMPT, greedy()))
            tg.start_soon(c.run)
            with anyio.fail_after(120):
                await c.wait_tokens(3)
                async with AsyncTcpClient(HOST, listen) as client:
                    for event in stt_request(4):
                        await client.write_event(event)
                    transcript = await client.read_event()
                    t_transcript = time.monotonic()
                    n_at_transcript = len(c.times)
                assert transcript is not None and transcript.type == "transcript"
                assert order.parked_at_audio_stop is True
                await c.wait_tokens(n_at_transcript + 1)
                assert c.times[n_at_transcript] - t_transcript >= HOLDOFF_MS / 1000.0 - 0.05
                await c.done.wait()
        metrics = sup.gate.metrics()
        assert metrics["pauses_total"].get("stt") == 1 and metrics["reactions"] == 1
        assert c.gen.finish_reason == "length" and c.gen.text == ref
    finally:
        await server.stop()
