"""The daemon as a real process under faults: stuck worker threads and signals, a broker killed, model
files removed or replaced, caches that cannot be written, and what tracebacks leave in the log."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import httpx
import pytest

from tests.daemon_process import DaemonProcess
from tests.models import SMOLLM2, require

pytestmark = pytest.mark.timeout(90)


async def _wait_engine(api: httpx.AsyncClient, state: str, within_s: float = 30) -> None:
    """Poll /status (a process we do not control) until the engine reports `state`."""
    with anyio.fail_after(within_s):
        while (await api.get("/status")).json()["engine"]["state"] != state:
            await anyio.sleep(0.05)


async def test_sigterm_exits_within_bound_while_a_worker_thread_is_stuck(tmp_path: Path) -> None:
    """SIGTERM during a prefill step that runs for many seconds in a worker thread ends the process
    within api.shutdown_timeout_s (+2 s), exit 0, with a `shutdown_forced` line naming the thread."""
    model = require(SMOLLM2)
    daemon = DaemonProcess(tmp_path, model=model, backend="numpy", n_ctx=2048, policy_chunk=2048,
                           extra="api: {warmup: false, shutdown_timeout_s: 3}")
    async with daemon as d, httpx.AsyncClient(base_url=d.url, timeout=60) as api, \
            anyio.create_task_group() as tg:
        prompt = [1000 + i % 4000 for i in range(2000)]  # one 2000-token prefill step on NumPy: >10 s

        async def request() -> None:
            try:
                await api.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            except httpx.HTTPError:
                pass  # the connection goes with the process
        tg.start_soon(request)
        await _wait_engine(api, "prefill")
        t0 = time.monotonic()
        d.signal(signal.SIGTERM)
        rc = await d.wait(within_s=3 + 2)
        elapsed = time.monotonic() - t0
        forced = await d.event("shutdown_forced", within_s=1)
    assert rc == 0 and elapsed < 5, (rc, elapsed)
    assert any("AnyIO worker thread" in t for t in forced["threads"]), forced
    assert forced["bound_s"] == 3
