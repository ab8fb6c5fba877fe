"""The web page's cost to the daemon: its CPU time with the page open (10 updates a second) against none, same run.

    python -m bench.ui_stream [--pairs 4] [--window-s 15] [--client page|sse]

One `genie-supervisor run` process on SmolLM2 (loaded, idle: no generation adds noise), simulated telemetry
every 50 ms (the store changes 20 times a second, so the timeline is sampled at its cap of 10 a second whether
or not anyone watches), and STT hints from this script every 250 ms (the gate pauses and opens, so the page's
view changes too). Windows of `--window-s` alternate between no subscriber and one subscriber (`--client page`:
the page in headless Chromium, as in tests/test_ui_browser.py; `sse`: a plain reader of /ui/events), in ABBA
order over `--pairs` pairs. The daemon's CPU time (user + system, psutil) over a window divided by the window's
wall time is its CPU share in % of one core; the stream's cost is the difference of the two means.

Writes bench/results/ui_stream-DATE.md and records the figures in bench/results/index.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.record import RESULTS, record
from tests.daemon import write_policy
from tests.models import SMOLLM2
from tests.net import free_port
from tests.ui_browser import browser, chromium_path, open_page


@contextmanager
def daemon(tmp: Path, model: Path | None) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`genie-supervisor run` on `model` with simulated telemetry every 50 ms; (process, base URL) once healthy."""
    port = free_port()
    cfg = tmp / "supervisor.yaml"
    cfg.write_text(
        "\n".join(
            [
                "telemetry: {platform: simulated, interval_s: 0.05}",
                f"policy: {{path: {write_policy(tmp / 'policy.yaml', holdoff_ms=50)}, watch: false}}",
                f"engine: {{model: {model if model else 'null'}, backend: numpy, threads: 1}}",
                f"http: {{listen: '127.0.0.1:{port}'}}",
                "api: {warmup: false}",
                "log: {format: json, level: warning}",
            ]
        )
        + "\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "genie_supervisor", "run", "--config", str(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not become healthy (exit {proc.poll()})")
            time.sleep(0.2)
        yield proc, base
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def hints(base: str, stop: threading.Event) -> None:
    """STT start and stop every 250 ms until `stop` (the gate pauses and opens)."""
    with httpx.Client(base_url=base, timeout=10) as api:
        n = 0
        while not stop.wait(0.25):
            api.post("/v1/voice/events", json={"service": "stt", "event": "stop" if n % 2 else "start", "session": "b"})
            n += 1


class SseReader:
    """A reader of /ui/events in a thread of its own, counting updates."""

    def __init__(self, base: str) -> None:
        self.updates = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base,), daemon=True)

    def _run(self, base: str) -> None:
        with httpx.Client(base_url=base, timeout=30) as api, api.stream("GET", "/ui/events") as r:
            for line in r.iter_lines():
                if line.startswith("event: update"):
                    self.updates += 1
                    self._ready.set()
                if self._stop.is_set():
                    return

    def __enter__(self) -> SseReader:
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


class PageReader:
    """The page itself in headless Chromium (one tab), counting the updates it received."""

    def __init__(self, context: Any, base: str) -> None:
        self._context = context
        self._base = base
        self._page: Any = None

    @property
    def updates(self) -> int:
        return int(self._page.evaluate("window.genieUiStats.updates"))

    def __enter__(self) -> PageReader:
        self._page, self.errors = open_page(self._context, f"{self._base}/ui")
        self._page.wait_for_selector("#conn[data-state=live]", timeout=30_000)
        return self

    def __exit__(self, *exc: object) -> None:
        self._page.close()


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model = SMOLLM2 if SMOLLM2.exists() else None
    use_page = args.client == "page"
    if use_page and chromium_path() is None:
        raise SystemExit("chromium is not installed (make system-deps); use --client sse")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="genie-ui-bench-") as tmp, daemon(Path(tmp), model) as (proc, base):
        ps = psutil.Process(proc.pid)
        stop = threading.Event()
        feeder = threading.Thread(target=hints, args=(base, stop), daemon=True)
        feeder.start()
        with browser() if use_page else _nothing() as context:
            time.sleep(2.0)  # past start-up work
            order = [m for i in range(args.pairs) for m in (("none", "open") if i % 2 == 0 else ("open", "none"))]
            for mode in order:
                reader: Any = None
                if mode == "open":
                    reader = PageReader(context, base) if use_page else SseReader(base)
                    reader.__enter__()
                    time.sleep(1.0)  # the snapshot is parsed and drawn before the window starts
                    u0 = reader.updates
                c0, t0 = cpu_s(ps), time.monotonic()
                time.sleep(args.window_s)
                c1, t1 = cpu_s(ps), time.monotonic()
                row = {"mode": mode, "cpu_pct": 100.0 * (c1 - c0) / (t1 - t0), "wall_s": t1 - t0}
                if reader is not None:
                    row["updates_per_s"] = (reader.updates - u0) / (t1 - t0)
                    reader.__exit__(None, None, None)
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        stop.set()
        feeder.join(5)
    return {"rows": rows, "model": model.name if model else None}


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def main(args: argparse.Namespace) -> None:
    result = measure(args)
    rows = result["rows"]
    none = [r["cpu_pct"] for r in rows if r["mode"] == "none"]
    opened = [r["cpu_pct"] for r in rows if r["mode"] == "open"]
    rate = [r["updates_per_s"] for r in rows if r["mode"] == "open"]
    base, with_page = sum(none) / len(none), sum(opened) / len(opened)
    cost, ups = with_page - base, sum(rate) / len(rate)
    what = "the page in headless Chromium" if args.client == "page" else "an SSE reader"
    headline = (
        f"{what} open at {ups:.1f} updates/s costs the daemon {cost:+.2f}% of a core "
        f"({with_page:.2f}% vs {base:.2f}% without, {with_page / base:.2f}x; target < 2%)"
    )
    print(headline)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else RESULTS / f"ui_stream-{stamp}.md"
    command = f"python -m bench.ui_stream {' '.join(sys.argv[1:])}".strip()
    lines = [
        "# bench/ui_stream.py",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, model {result['model']}, "
        f"client: {what}, windows of {args.window_s:g} s in ABBA order)",
        "",
        "| window | subscriber | daemon CPU (% of a core) | updates/s |",
        "|---|---|---|---|",
        *(
            f"| {i + 1} | {r['mode']} | {r['cpu_pct']:.2f} | {r.get('updates_per_s', 0):.1f} |"
            for i, r in enumerate(rows)
        ),
        "",
        f"Mean without: {base:.2f}%; with: {with_page:.2f}%; the stream's cost: {cost:+.2f}% of a core.",
        "",
    ]
    out.write_text("\n".join(lines), encoding="utf-8")
    record(
        "ui_stream",
        out,
        {
            "ui_stream_cpu_pct": (round(cost, 2), "% of a core"),
            "ui_stream_cpu_ratio": (round(with_page / base, 3), "x"),
            "ui_stream_updates_per_s": (round(ups, 1), "/s"),
        },
        reference="no subscriber, same daemon, alternating windows",
        headline=headline,
        command="`python -m bench.ui_stream`",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="pairs of windows (ABBA order)")
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--client", choices=["page", "sse"], default="page")
    parser.add_argument("--out", default=None, help="result file (default bench/results/ui_stream-DATE.md)")
    main(parser.parse_args())
