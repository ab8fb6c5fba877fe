"""Warm start: the daemon's process start to ready against the engine's own load, same run.

Every sample is a fresh process, timed by this parent from just before it is spawned:
- **engine**: `python -c 'load_model(PATH)'` until the model is loaded (the reference: what the
  same file costs the engine alone, interpreter start, imports and CUDA start included);
- **daemon**: `python -m genie_supervisor run` on the same file (simulated telemetry, no MQTT, no
  services) until its ``supervisor_ready`` line: policy, HTTP server and model loaded, a first
  token servable; the line's own ``start_to_ready_s`` / ``load_s`` / ``prewarm_s`` /
  ``early_load_s`` / ``early_skipped`` are kept too, and whether ``model_loaded`` says ``early``
  (the model loaded by the prewarm thread from process start, taken over);
- with ``--against DIR``, the daemon of another checkout (e.g. ``git worktree add /tmp/old HEAD~3``)
  in the same rounds, alternating, so both see the same page cache and machine load.

With ``--first-reply``, each daemon also gets a prompt cache (a folder per checkout, kept across
the run's processes) and, once ready, one chat request with `bench.prompt_cache`'s ~2,000-token
entity-list system prompt (sized with the model's own tokenizer) and its question (max_tokens 1):
the first reply after a restart, what a Home Assistant user waits for. Its time from the spawn and
from ready, and the prompt tokens restored from the disk cache (the warm-up round writes the file)
are kept.

One unmeasured round first fills the page cache, the kernel cache (a folder shared by every
process of the run: CUPY_CACHE_DIR, GENIE_KERNEL_CACHE_DIR) and Python's bytecode cache (the
children never inherit PYTHONDONTWRITEBYTECODE: an installed package has its .pyc files, and
without them every import compiles its source, ~3x the import time), so the rounds measure a
*warm* start: warm page cache, warm kernel cache, compiled modules.

    python -m bench.warm_start --preset qwen3-4b-q4_k_m --backend cupy --rounds 5
    python -m bench.warm_start --model m.gguf --backend native --against /tmp/old
    python -m bench.warm_start --model m.gguf --backend native --first-reply
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ENGINE_CHILD = (
    "import json, sys\n"
    "from engine import load_model\n"
    "m = load_model(sys.argv[1], backend=sys.argv[2], n_ctx=int(sys.argv[3]), kv_dtype=sys.argv[4])\n"
    "print('LOADED', json.dumps(getattr(m, 'load_phases', {})), flush=True)\n"
)
READY_EVENT = '"supervisor_ready"'
TIMELINE = ("supervisor_starting", "http_listening", "model_loading", "model_loaded", "supervisor_ready")
"""The daemon's log events whose arrival this parent times (seconds after the spawn)."""
COMPONENTS = {
    "python": "pass",
    "import engine": "import engine",
    "import cupy + context": "import cupy; cupy.cuda.runtime.free(0)",
    "import genie_supervisor.app": "import genie_supervisor.app",
}
"""What a bare process spends on each piece (`--components`)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def system_prompt(model: str, n_tokens: int = 2000) -> str:
    """`bench.prompt_cache`'s entity-list system prompt, at most `n_tokens` tokens of `model`'s
    tokenizer (read here, from the file's header alone: no weights in this parent process)."""
    from bench.prompt_cache import sized_entity_list
    from engine import open_model_file
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_model_file(model, header_only=True))
    return sized_entity_list(lambda text: len(tok.encode(text)), n_tokens)


def first_reply(url: str, system: str, t0: float) -> dict[str, Any]:
    """One chat request (the system prompt, a question, max_tokens 1): seconds from the spawn
    (`t0`) to its answer, and the prompt and restored tokens its usage reports."""
    import httpx

    from bench.prompt_cache import QUESTION

    body = {
        "model": "default",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
        "max_tokens": 1,
        "temperature": 0,
    }
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    resp.raise_for_status()
    usage = resp.json()["usage"]
    return {
        "first_reply_s": round(time.perf_counter() - t0, 3),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
    }


def daemon_config(
    folder: Path, model: str, backend: str, n_ctx: int, kv: str, policy: str, cache: Path | None = None
) -> tuple[Path, str]:
    """A daemon config for `model`: loopback HTTP on a free port, no MQTT, no services; a prompt
    cache in `cache` when given. Returns the file and the API's base URL."""
    path = folder / "supervisor.yaml"
    port = free_port()
    path.write_text(
        "node_id: warmstart\n"
        "log: {level: info, format: json}\n"
        f"http: {{listen: '127.0.0.1:{port}'}}\n"
        "api: {warmup: false}\n"
        f"engine: {{model: {json.dumps(model)}, backend: {backend}, n_ctx: {n_ctx}, kv_dtype: {kv}}}\n"
        f"policy: {{path: {json.dumps(policy)}, watch: false}}\n"
        "telemetry: {platform: simulated}\n"
        + (f"prompt_cache: {{dir: {json.dumps(str(cache))}, min_tokens: 16}}\n" if cache is not None else "")
    )
    return path, f"http://127.0.0.1:{port}"


def child_env(code: Path, kernels: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(code), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env["CUPY_CACHE_DIR"] = str(kernels / "cupy")
    env["GENIE_KERNEL_CACHE_DIR"] = str(kernels / "native")
    env["GENIE_STRINGS_CACHE_DIR"] = str(kernels / "strings")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # warm includes the bytecode cache (pip writes it at install)
    return env


def time_until(
    cmd: list[str],
    env: dict[str, str],
    marker: str,
    cwd: Path,
    stop: bool,
    events: dict[str, float] | None = None,
    then: Callable[[float], dict[str, Any]] | None = None,
) -> tuple[float, str]:
    """Seconds from spawning `cmd` to its first stdout line holding `marker` (that line too); the
    arrival of each TIMELINE event goes into `events`; `then(t0)` runs next, its fields going into
    `events` too; the process is then stopped (SIGTERM) when `stop`, else awaited."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        for line in proc.stdout:
            if events is not None:
                for name in TIMELINE:
                    if f'"{name}"' in line and name not in events:
                        events[name] = round(time.perf_counter() - t0, 3)
                        if name == "model_loaded":
                            loaded = json.loads(line)
                            events["phases"] = loaded.get("phases_s")  # type: ignore[assignment]
                            events["early"] = loaded.get("early")  # type: ignore[assignment]
            if marker in line:
                s = time.perf_counter() - t0
                if then is not None and events is not None:
                    events.update(then(t0))
                return s, line
            seen.append(line)
        raise RuntimeError(f"{cmd[:3]} ended before {marker}:\n" + "".join(seen[-30:]))
    finally:
        if stop and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sample(kind: str, code: Path, a: argparse.Namespace, folder: Path, kernels: Path) -> dict[str, Any]:
    env = child_env(code, kernels)
    cache = folder / f"prompt-cache-{abs(hash(str(code)))}" if a.first_reply else None
    cfg, url = daemon_config(folder, a.model, a.backend, a.n_ctx, a.kv, a.policy, cache)
    if kind == "engine":
        cmd = [sys.executable, "-c", ENGINE_CHILD, a.model, a.backend, str(a.n_ctx), a.kv]
        s, line = time_until(cmd, env, "LOADED", code, stop=False)
        return {"s": s, "phases": json.loads(line.split(" ", 1)[1])}
    cmd = [sys.executable, "-m", "genie_supervisor", "run", "--config", str(cfg)]
    events: dict[str, float] = {}
    then = (lambda t0: first_reply(url, a.system, t0)) if a.first_reply else None
    s, line = time_until(cmd, env, READY_EVENT, code, stop=True, events=events, then=then)
    event = json.loads(line)
    return {
        "s": s,
        **{
            k: event.get(k)
            for k in ("start_to_ready_s", "load_s", "prewarm_s", "early_load_s", "early_skipped", "backend")
        },
        "events": events,
    }


def components(code: Path, kernels: Path, rounds: int) -> dict[str, float]:
    """Median seconds of a bare process doing each COMPONENTS piece (after one unmeasured run)."""
    env = child_env(code, kernels)
    out = {}
    for name, stmt in COMPONENTS.items():
        times = []
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", stmt], env=env, cwd=code, capture_output=True, check=False)
            if done.returncode:
                break  # e.g. no CUDA here
            if r:
                times.append(time.perf_counter() - t0)
        if times:
            out[name] = round(statistics.median(times), 3)
            print(f"component {name:30s} {out[name]:.3f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file (default: generate --preset into a temp folder)")
    ap.add_argument(
        "--preset", default="qwen3-4b-q4_k_m", help="engine.synth preset generated when --model is not given"
    )
    ap.add_argument("--backend", default="auto", choices=["auto", "numpy", "native", "cupy"])
    ap.add_argument("--n-ctx", type=int, default=8192)
    ap.add_argument("--kv", default="int8", choices=["f16", "int8"])
    ap.add_argument("--policy", default=str(ROOT / "policies" / "orin-nano-8gb.yaml"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--against", help="another checkout whose daemon runs in the same rounds (before/after)")
    ap.add_argument("--out", default=str(RESULTS), help="folder of the result files")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--components", action="store_true", help="also time a bare process's imports and CUDA start")
    ap.add_argument(
        "--first-reply",
        action="store_true",
        help="also time each daemon's first chat reply (~2,000-token system prompt) with a prompt cache on disk",
    )
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="warm-start-") as tmp:
        folder = Path(tmp)
        if a.model is None:
            from engine.synth import preset_config, write_config

            a.model = str(folder / f"{a.preset}.gguf")
            t0 = time.perf_counter()
            write_config(a.model, preset_config(a.preset, fast=True))
            print(f"generated {a.preset} ({os.path.getsize(a.model) / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
        a.system = system_prompt(a.model) if a.first_reply else ""
        kernels = folder / "kernels"
        codes = {"daemon": ROOT, "engine": ROOT}
        if a.against:
            codes["daemon_before"] = Path(a.against).resolve()
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in codes}
        for r in range(a.rounds + 1):  # round 0 warms the page cache and the kernel cache
            for kind, code in codes.items():
                got = sample("engine" if kind == "engine" else "daemon", code, a, folder, kernels)
                tag = "warm-up" if r == 0 else f"round {r}"
                print(f"{tag:8s} {kind:14s} {got['s']:.3f} s  {json.dumps({k: v for k, v in got.items() if k != 's'})}")
                if r:
                    runs[kind].append(got)
        parts = components(ROOT, kernels, a.rounds) if a.components else {}
    report(a, runs, parts)


def report(a: argparse.Namespace, runs: dict[str, list[dict[str, Any]]], parts: dict[str, float]) -> None:
    med = {k: statistics.median(x["s"] for x in v) for k, v in runs.items()}
    backend = next((x.get("backend") for x in runs["daemon"] if x.get("backend")), a.backend)
    lines = [
        f"{k:14s} start -> ready median {v:.3f} s  ({', '.join(format(x['s'], '.2f') for x in runs[k])})"
        for k, v in med.items()
    ]
    ratio = med["daemon"] / med["engine"]
    lines.append(f"daemon / engine-only load: {ratio:.2f}x")
    taken = [x.get("events", {}).get("early") for x in runs["daemon"]]
    skipped = {x.get("early_skipped") for x in runs["daemon"]} - {None}
    lines.append(
        f"early load taken over in {taken.count(True)} of {len(taken)} rounds" + (f" ({skipped})" if skipped else "")
    )
    lines += [f"component {k}: {v:.3f} s" for k, v in parts.items()]
    figures = {"daemon_start_to_ready_s": (round(med["daemon"], 3), "s"), "daemon_vs_engine": (round(ratio, 3), "x")}
    if "daemon_before" in med:
        lines.append(f"daemon after / before: {med['daemon'] / med['daemon_before']:.2f}x")
        figures["daemon_before_s"] = (round(med["daemon_before"], 3), "s")
    for kind in [k for k in runs if k != "engine" and all("first_reply_s" in x["events"] for x in runs[k])]:
        ev = [x["events"] for x in runs[kind]]
        reply = statistics.median(e["first_reply_s"] for e in ev)
        after = statistics.median(e["first_reply_s"] - e["supervisor_ready"] for e in ev)
        cached = sorted({e.get("cached_tokens") for e in ev}, key=str)
        prompt = sorted({e.get("prompt_tokens") for e in ev}, key=str)
        lines.append(
            f"{kind:14s} first reply median {reply:.3f} s from the spawn, {after:.3f} s after ready "
            f"(prompt tokens {prompt}, restored from disk {cached})"
        )
        figures[f"{kind}_first_reply_s"] = (round(reply, 3), "s")
        figures[f"{kind}_first_reply_after_ready_s"] = (round(after, 3), "s")
    for line in lines:
        print(line)
    from bench.record import record, result_file

    out = result_file(a.out, "warm_start", a.tag)
    command = f"python -m bench.warm_start {' '.join(sys.argv[1:])}".strip()
    out.write_text(
        f"# bench/warm_start.py\n\nCommand: `{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
        f"backend {backend}, n_ctx {a.n_ctx}, {a.kv} KV)\n\n```\n"
        + "\n".join(lines)
        + "\n```\n\nSamples:\n\n```json\n"
        + json.dumps(runs, indent=1)
        + "\n```\n"
    )
    print(f"wrote {out}")

    record(
        "warm_start",
        out,
        figures,
        reference="the engine's own load_model of the same file in a fresh process, same run",
        headline=f"{backend}: daemon start to ready {med['daemon']:.2f} s, {ratio:.2f}x the engine-only load",
        command="`python -m bench.warm_start`",
    )


if __name__ == "__main__":
    main()
