"""Decode A/B: this checkout's engine against another checkout's, same run, fresh processes alternating.

Each sample is a fresh process whose working directory and ``PYTHONPATH`` are one checkout, so it
imports that checkout's engine. It loads the model (``--backend``) and then:

- **times the prefill** of a seeded random prompt of ``--prompt`` tokens through
  ``Model.step_logits`` (the served path: chunks, graphs, the logits read back), median of
  ``--gen-runs`` after one warm-up;
- **fingerprints the logits** of that prefill and of ``--steps`` one-token greedy steps after it
  (SHA-256 of their float32 bytes): a change meant to keep the arithmetic (a kernel that loads
  earlier, code moved) must give the same hash in both checkouts;
- **times `Model.generate`** (what the API serves): greedy, ``ignore_eos``, ``--tokens`` tokens
  after the prompt, timed by its consumer from the first token to the last, median of
  ``--gen-runs`` generations (the prompt prefilled again each time);
- where the model has a graph decoder (CuPy), **replays the step's graph** ``--tokens`` times with
  nothing read back (the GPU alone), median of 5.

Only the engine's public pieces are used in the child (``load_model``, ``Model.step_logits``,
``Model.generate``, the decoder's replay where present), so any recent checkout can be the
reference. The checkouts alternate round by round (``--rounds``), so both see the same machine
state; the report gives each figure's median per checkout, the ratio this / reference, and whether
the logits hashes agree. A light tool for a short device session: the whole comparison of two
engines on two model shapes takes about a minute on an H200 (``bench/engine_gpu.py`` is the full
benchmark: prefill by tile precision, memory, llama.cpp).

    python -m bench.decode_ab --against /tmp/prev --preset qwen3-4b-q4_k_m --preset smollm2-135m-q4_1 --backend cupy
    python -m bench.decode_ab --against /tmp/prev --model m.gguf --backend native --tokens 32
    python -m bench.decode_ab --against . --env GENIE_QGEMV_MIN_BLOCKS=4 --preset qwen3-4b-q4_k_m --backend cupy
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
FIGURES = ("prefill_tok_s", "generate_tok_s", "gpu_replay_tok_s")

CHILD = r"""
import hashlib, json, os, sys, time
import anyio
import numpy as np
from engine import SamplingParams, load_model

path, backend, n_ctx, n_prompt, n_tok, n_steps, gen_runs = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8])
m = load_model(path, backend=backend, n_ctx=n_ctx)
prompt = np.random.default_rng(0).integers(0, m.spec.n_vocab, n_prompt).tolist()

def host(a):
    return np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float32).ravel()

pre = []
for _ in range(gen_runs + 2):  # the first prefill compiles and warms; the median of the rest counts
    m.transformer.kv.tokens = []
    t0 = time.perf_counter()
    lg = host(m.step_logits(prompt, 0))
    pre.append(time.perf_counter() - t0)
fp, tok, pos = hashlib.sha256(lg.tobytes()), int(lg.argmax()), n_prompt
for _ in range(n_steps):
    lg = host(m.step_logits([tok], pos))
    fp.update(lg.tobytes())
    tok, pos = int(lg.argmax()), pos + 1

async def generate():
    g = m.generate(prompt, SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True))
    times = [time.perf_counter() async for _ in g]  # one event a token, then maybe a text tail
    k = g.stats.completion_tokens
    return (k - 1) / (times[k - 1] - times[0])

rates = []
for _ in range(gen_runs):
    m.transformer.kv.tokens = []
    rates.append(anyio.run(generate))
out = {"logits_sha": fp.hexdigest()[:16], "generate_tok_s": float(np.median(rates)),
       "prefill_tok_s": n_prompt / float(np.median(pre[1:])),
       "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("GENIE_")}}
dec = getattr(m, "decoder", None)
if dec is not None and hasattr(dec, "_launch") and hasattr(dec, "stream"):
    import cupy as cp
    reps = []
    for _ in range(5):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(dec.stream)
        for _ in range(n_tok):
            dec._launch(tok, pos)
        stop.record(dec.stream)
        stop.synchronize()
        reps.append(n_tok / (cp.cuda.get_elapsed_time(start, stop) / 1e3))
    out["gpu_replay_tok_s"] = float(np.median(reps))
print("RESULT " + json.dumps(out), flush=True)
"""


def sample(code: Path, model: str, a: argparse.Namespace, extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One fresh process of checkout `code` on `model` (`extra`: more environment variables): its
    RESULT line (with the `GENIE_*` variables it ran with)."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(code), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    args = [str(v) for v in (model, a.backend, a.n_ctx, a.prompt, a.tokens, a.steps, a.gen_runs)]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args], cwd=code, env=env, capture_output=True, text=True, timeout=a.timeout
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{code} on {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return dict(json.loads(lines[-1].removeprefix("RESULT ")))


def summarise(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model: each figure's median per checkout ("this", "reference"), the ratio this /
    reference, and whether every sample of both had the same logits hash."""
    rows = []
    for model in dict.fromkeys(s["model"] for s in samples):
        mine = [s for s in samples if s["model"] == model]
        row: dict[str, Any] = {"model": model, "logits_identical": len({s["logits_sha"] for s in mine}) == 1}
        for fig in FIGURES:
            med = {}
            for side in ("this", "reference"):
                xs = [s[fig] for s in mine if s["side"] == side and fig in s]
                if xs:
                    med[side] = statistics.median(xs)
            if len(med) == 2:
                row[fig] = {
                    **{k: round(v, 1) for k, v in med.items()},
                    "ratio": round(med["this"] / med["reference"], 3),
                }
        rows.append(row)
    return rows


def report(rows: list[dict[str, Any]]) -> list[str]:
    """The result table's lines."""
    out = ["| model | figure | this | reference | this / reference | logits |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        for fig in FIGURES:
            if fig in r:
                f = r[fig]
                same = "identical" if r["logits_identical"] else "DIFFER"
                out.append(
                    f"| {r['model']} | {fig} | {f['this']:,.1f} | {f['reference']:,.1f} | {f['ratio']:.3f} | {same} |"
                )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--against", required=True, help="the reference checkout (e.g. `git worktree add /tmp/prev HEAD~1`)"
    )
    ap.add_argument("--model", action="append", default=[], help="GGUF file (repeatable)")
    ap.add_argument(
        "--preset", action="append", default=[], help="engine.synth preset generated into a temp folder (repeatable)"
    )
    ap.add_argument("--backend", default="auto", choices=["auto", "numpy", "native", "cupy"])
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens before the decode")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated (and graph replays)")
    ap.add_argument("--steps", type=int, default=6, help="decode steps whose logits are fingerprinted")
    ap.add_argument("--gen-runs", type=int, default=3, help="Model.generate runs a sample (median)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (each checkout once a round)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a sample may take")
    ap.add_argument("--out", default=str(RESULTS), help="folder of the result file")
    ap.add_argument("--tag", default="", help="suffix of the result file name")
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of this checkout's processes only (repeatable; with --against . "
        "it compares an EngineOptions setting, e.g. GENIE_QGEMV_MIN_BLOCKS=4, with the default)",
    )
    a = ap.parse_args(argv)
    extra = dict(kv.split("=", 1) for kv in a.env)
    sides = {"this": ROOT, "reference": Path(a.against).resolve()}
    if not (sides["reference"] / "engine").is_dir():
        ap.error(f"--against {a.against}: no engine/ folder there")
    with tempfile.TemporaryDirectory() as tmp:
        models = list(a.model)
        for preset in a.preset:
            from engine.synth import preset_config, write_config

            path = os.path.join(tmp, preset + ".gguf")
            write_config(path, preset_config(preset, fast=True))
            models.append(path)
        if not models:
            ap.error("give --model or --preset")
        samples = []
        for rnd in range(a.rounds):
            for side, code in sides.items() if rnd % 2 == 0 else reversed(sides.items()):
                for model in models:
                    env = extra if side == "this" else None
                    s = {"round": rnd, "side": side, "model": Path(model).stem, **sample(code, model, a, env)}
                    print(json.dumps(s), flush=True)
                    samples.append(s)
    rows = summarise(samples)
    lines = report(rows)
    print("\n".join(lines))
    from bench.record import record, result_file

    out = result_file(a.out, "decode_ab", a.tag)
    command = f"python -m bench.decode_ab {' '.join(sys.argv[1:] if argv is None else argv)}".strip()
    out.write_text(
        f"# bench/decode_ab.py\n\nCommand: `{command}` ({time.strftime('%Y-%m-%d')}, backend {a.backend}, "
        f"reference {sides['reference']})\n\n"
        + "\n".join(lines)
        + "\n\nSamples:\n\n```\n"
        + "\n".join(json.dumps(s) for s in samples)
        + "\n```\n"
    )
    print(f"wrote {out}")

    figures = {f"{r['model']}_{fig}_ratio": (r[fig]["ratio"], "x") for r in rows for fig in FIGURES if fig in r}
    record(
        "decode_ab",
        out,
        figures,
        reference=f"the engine of {sides['reference']}, same run, alternating fresh processes",
        headline="; ".join(
            f"{r['model']} "
            + ", ".join(f"{fig.removesuffix('_tok_s')} {r[fig]['ratio']:.3f}x" for fig in FIGURES[:2] if fig in r)
            + ("" if r["logits_identical"] else " (logits differ)")
            for r in rows
        ),
        command="`python -m bench.decode_ab --against DIR`",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
