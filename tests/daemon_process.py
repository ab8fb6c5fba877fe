"""`genie-supervisor run` as a real process: its config, its JSON log lines as awaitable events, signals.

async with DaemonProcess(tmp_path, model=SMOLLM2) as d:     # returns once `supervisor_ready` is logged
    await d.event("policy_loaded")
    d.signal(signal.SIGTERM)
    assert await d.wait(within_s=7) == 0
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from tests.awaitlog import Log
from tests.daemon import write_policy
from tests.net import free_port


class DaemonProcess:
    """One daemon process with a config written from `engine` / `policy_body` / `extra` YAML lines."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        model: Path | None,
        backend: str = "auto",
        n_ctx: int = 512,
        extra: str = "",
        policy_chunk: int = 16,
        env: dict[str, str] | None = None,
        ready_within_s: float = 60,
    ) -> None:
        self.port = free_port()
        """The API's port."""
        self.policy = write_policy(tmp_path / "policy.yaml", "faults")
        """The policy file (STT pauses; `policy_chunk` tokens a prefill step)."""
        self.policy.write_text(
            self.policy.read_text().replace("prefill_chunk_tokens: 16", f"prefill_chunk_tokens: {policy_chunk}")
        )
        self.config = tmp_path / "supervisor.yaml"
        """The config file."""
        self.config.write_text(
            "\n".join(
                [
                    "telemetry: {platform: simulated, interval_s: 0.05}",
                    f"policy: {{path: {self.policy}, watch: false}}",
                    f"engine: {{model: {model if model else 'null'}, backend: {backend}, n_ctx: {n_ctx}}}",
                    f"http: {{listen: '127.0.0.1:{self.port}'}}",
                    "log: {format: json}",
                    extra if "api:" in extra else "api: {warmup: false}\n" + extra,
                ]
            )
            + "\n",
            encoding="utf-8",
        )
        self.log = Log()
        """Every stdout line as a dict (JSON lines; anything else as ``{"event": None, "raw": line}``)."""
        self.stderr = tmp_path / "daemon.stderr"
        """Where stderr goes."""
        self.returncode: int | None = None
        """Exit status once it exited."""
        self._env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        self._env.update(env or {})
        self._cwd = tmp_path
        self._ready_within_s = ready_within_s
        self._proc: anyio.abc.Process | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def url(self) -> str:
        """The API's base URL."""
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> DaemonProcess:
        with self.stderr.open("wb") as err:
            self._proc = await anyio.open_process(
                [sys.executable, "-m", "genie_supervisor", "run", "--config", str(self.config)],
                cwd=self._cwd,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._pump)
        try:
            await self.event("supervisor_ready", within_s=self._ready_within_s)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.kill()
        if proc is not None:
            with anyio.fail_after(10):
                await proc.wait()
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)

    async def _pump(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        buf = b""
        async for chunk in self._proc.stdout:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                text = raw.decode("utf-8", "replace")
                try:
                    item = json.loads(text)
                except ValueError:
                    item = None
                self.log(item if isinstance(item, dict) else {"event": None, "raw": text})
        self.log({"event": "<eof>"})

    def lines(self) -> str:
        """The whole log so far, as text (for assertion messages and greps)."""
        return "\n".join(json.dumps(e) if e.get("event") is not None else e["raw"] for e in self.log.items)

    async def event(
        self,
        name: str,
        pred: Callable[[dict[str, Any]], Any] = lambda _e: True,
        *,
        start: int = 0,
        within_s: float = 10,
    ) -> dict[str, Any]:
        """The first log entry from index `start` with event `name` matching `pred` (bounded wait)."""
        try:
            entry: dict[str, Any] = await self.log.wait_for(
                lambda e: e.get("event") == name and pred(e), start=start, within_s=within_s
            )
        except TimeoutError:
            raise AssertionError(
                f"no {name!r} log line within {within_s} s; log:\n{self.lines()[-6000:]}"
                f"\nstderr:\n{self.stderr.read_text()[-3000:]}"
            ) from None
        return entry

    def mark(self) -> int:
        """Index of the next log entry (pass as `start` to wait only for what comes after now)."""
        return len(self.log.items)

    def signal(self, signum: signal.Signals) -> None:
        """Send a signal to the daemon."""
        assert self._proc is not None
        self._proc.send_signal(signum)

    async def sigterm(self, within_s: float) -> tuple[int, float]:
        """Send SIGTERM and wait (bounded) for the exit: (exit status, seconds from the signal)."""
        t0 = time.monotonic()
        self.signal(signal.SIGTERM)
        rc = await self.wait(within_s)
        return rc, time.monotonic() - t0

    def forced_exits(self) -> list[str]:
        """The log's ``shutdown_forced`` lines (a thread held the exit until the bound)."""
        return [x for x in self.lines().splitlines() if "shutdown_forced" in x]

    async def wait(self, within_s: float) -> int:
        """Wait (bounded) for the process to exit; its exit status."""
        assert self._proc is not None
        with anyio.fail_after(within_s):
            self.returncode = await self._proc.wait()
        return self.returncode
