"""Added latency of the Wyoming proxy: the same STT request direct and through the proxy.

Three processes, as on the box: a Wyoming STT server (the `wyoming` package, answers at once), the
proxy (genie_supervisor.watchers.WyomingProxy, hold off) and this client, which sends what Home
Assistant sends (transcribe, audio-start, N x 100 ms chunks, audio-stop) over a fresh connection
per request. Requests alternate direct / proxied. Two latencies per request:

- ``request``: connect -> all sent -> transcript received (the whole exchange, including a 3 ms
  pause before audio-stop);
- ``stop->transcript``: audio-stop sent -> transcript received (the voice path's critical part;
  the pause lets the audio drain first, as it does when audio streams in real time).

Prints p50/p99 in microseconds for both routes and the proxied/direct ratio. Under a minute.

    .venv/bin/python -m bench.wyoming_proxy [--requests 1000] [--chunks 20]
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import time
import warnings

import anyio

HOST = "127.0.0.1"


def _quiet_wyoming() -> None:
    with warnings.catch_warnings():  # audioop is deprecated on 3.11+
        warnings.simplefilter("ignore", DeprecationWarning)
        import wyoming.audio  # noqa: F401


# -- the three roles ----------------------------------------------------------------------------


async def run_server(port: int) -> None:
    _quiet_wyoming()
    from wyoming.asr import Transcript
    from wyoming.event import Event
    from wyoming.server import AsyncEventHandler, AsyncTcpServer

    class Handler(AsyncEventHandler):
        async def handle_event(self, event: Event) -> bool:
            if event.type == "audio-stop":
                await self.write_event(Transcript("turn on the kitchen lights").event())
                return False
            return True

    server = AsyncTcpServer(HOST, port)
    await server.start(Handler)
    print("READY", port, flush=True)
    await anyio.sleep_forever()


async def run_proxy(upstream_port: int) -> None:
    import structlog

    from genie_supervisor.watchers import WyomingProxy

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    proxy = WyomingProxy(
        "whisper",
        HOST,
        0,
        HOST,
        upstream_port,
        "stt",
        lambda obs: None,
        hold_audio_stop_until_parked=False,
        health_interval_s=None,
    )
    async with anyio.create_task_group() as tg:
        port = await tg.start(proxy.serve)
        print("READY", port, flush=True)


def request_bytes(chunks: int) -> tuple[bytes, bytes]:
    """(everything up to audio-stop, audio-stop) as Home Assistant would write them."""
    _quiet_wyoming()
    from wyoming.asr import Transcribe
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.event import write_event

    head = io.BytesIO()
    write_event(Transcribe(language="en").event(), head)
    write_event(AudioStart(16000, 2, 1).event(), head)
    for i in range(chunks):
        write_event(AudioChunk(16000, 2, 1, bytes([i % 256]) * 3200).event(), head)
    stop = io.BytesIO()
    write_event(AudioStop().event(), stop)
    return head.getvalue(), stop.getvalue()


async def one_request(port: int, head: bytes, stop: bytes) -> tuple[float, float]:
    t0 = time.perf_counter()
    async with await anyio.connect_tcp(HOST, port) as stream:
        await stream.send(head)
        await anyio.sleep(0.003)  # audio streams in real time: the head is through by audio-stop
        t1 = time.perf_counter()
        await stream.send(stop)
        received = b""
        while b"\n" not in received or b"turn on" not in received:
            received += await stream.receive()
        t2 = time.perf_counter()
    return (t2 - t0) * 1e6, (t2 - t1) * 1e6


# -- driver -------------------------------------------------------------------------------------


def start(role: str, port: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--role", role, "--port", str(port)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        proc.kill()
        raise RuntimeError(f"{role} did not start")
    return proc, int(line[1])


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def measure(server_port: int, proxy_port: int, requests: int, chunks: int) -> None:
    head, stop = request_bytes(chunks)
    for _ in range(20):  # warm up both routes
        await one_request(server_port, head, stop)
        await one_request(proxy_port, head, stop)
    results: dict[str, list[tuple[float, float]]] = {"direct": [], "proxy": []}
    for _ in range(requests):
        results["direct"].append(await one_request(server_port, head, stop))
        results["proxy"].append(await one_request(proxy_port, head, stop))

    print(f"{requests} requests per route, {chunks} x 100 ms audio chunks (3200 B) each, fresh connection per request")
    print(f"{'route':<8} {'metric':<18} {'p50 us':>10} {'p99 us':>10} {'mean us':>10}")
    summary = {}
    for metric, index in (("request", 0), ("stop->transcript", 1)):
        for route in ("direct", "proxy"):
            values = [r[index] for r in results[route]]
            summary[route, metric] = (pct(values, 0.5), pct(values, 0.99))
            print(
                f"{route:<8} {metric:<18} {pct(values, 0.5):>10.0f} {pct(values, 0.99):>10.0f} "
                f"{statistics.fmean(values):>10.0f}"
            )
    for metric in ("request", "stop->transcript"):
        d50, d99 = summary["direct", metric]
        p50, p99 = summary["proxy", metric]
        print(
            f"{metric:<18} added p50 {p50 - d50:+.0f} us, p99 {p99 - d99:+.0f} us; "
            f"ratio p50 {p50 / d50:.2f}x, p99 {p99 / d99:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["bench", "server", "proxy"], default="bench")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--chunks", type=int, default=20)
    args = parser.parse_args()
    backend_options = {"use_uvloop": True}
    if args.role == "server":
        anyio.run(run_server, args.port, backend_options=backend_options)
        return
    if args.role == "proxy":
        anyio.run(run_proxy, args.port, backend_options=backend_options)
        return
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        free = s.getsockname()[1]
    server, server_port = start("server", free)
    proxy, proxy_port = start("proxy", server_port)
    try:
        anyio.run(measure, server_port, proxy_port, args.requests, args.chunks, backend_options=backend_options)
    finally:
        for proc in (proxy, server):
            proc.terminate()
            proc.wait(timeout=5)


if __name__ == "__main__":
    main()
