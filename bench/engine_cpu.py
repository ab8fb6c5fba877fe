"""CPU engine speed on the real demo models, beside llama.cpp's figures, as a ratio.

    python bench/engine_cpu.py [--threads 2] [--prompt-tokens 256] [--gen-tokens 64]
                               [--backends numpy,native] [--models smollm2,gemma3]

Each model and backend runs in its own process (so peak RSS is its own) with BLAS and OpenMP
limited to --threads. `numpy` is the float32 reference backend, `native` the compiled quantized
GEMV (`engine/backends/cpu_native.py`).
The llama.cpp reference (2 threads, this kind of 2-core machine) comes from issue 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP = {  # tokens/s at 2 threads, llama.cpp CPU build on a 2-core machine (issue 2)
    "smollm2": {"decode_tps": 80.0, "prefill_tps": 230.0},
    "gemma3": {"decode_tps": 36.0, "prefill_tps": 420.0},
}


def _child(name: str, backend: str, prompt_tokens: int, gen_tokens: int) -> None:
    from engine import load_model
    from engine.cli import measure
    from genie_supervisor.fetch import fetch

    t0 = time.perf_counter()
    model = load_model(fetch(name), backend=backend)
    load_s = time.perf_counter() - t0
    measure(model, 16, 4)  # warm-up
    r = measure(model, prompt_tokens, gen_tokens)
    r["load_s"] = load_s
    r["weights_mb"] = model.info.weights_bytes / 2**20
    print(json.dumps(r))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--backends", default="numpy,native", help="comma-separated: numpy, native")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="numpy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.backend, args.prompt_tokens, args.gen_tokens)
        return 0
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "GENIE_THREADS"):
        env[var] = str(args.threads)
    lines = [
        f"# engine_cpu — {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} threads, prompt {args.prompt_tokens}, decode {args.gen_tokens}, "
        f"load average {os.getloadavg()[0]:.2f} at start",
        "",
        "| model | backend | prefill tok/s | llama.cpp | ratio | decode tok/s | llama.cpp | ratio "
        "| peak RSS MiB | load s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = [(m, b) for m in args.models.split(",") for b in args.backends.split(",")]
    for name, backend in runs:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                name,
                "--backend",
                backend,
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--gen-tokens",
                str(args.gen_tokens),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        ref = LLAMA_CPP[name]
        lines.append(
            f"| {name} | {backend} | {r['prefill_tps']:.0f} | {ref['prefill_tps']:.0f} | "
            f"{r['prefill_tps'] / ref['prefill_tps']:.2f}x | {r['decode_tps']:.1f} | "
            f"{ref['decode_tps']:.0f} | {r['decode_tps'] / ref['decode_tps']:.2f}x | "
            f"{r['peak_rss_mb']:.0f} | {r['load_s']:.1f} |"
        )
    lines.append(
        f"\nload average at end: {os.getloadavg()[0]:.2f} (other work on the machine skews this)"
    )
    text = "\n".join(lines)
    print(text)
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "engine_cpu.md").write_text(text + "\n\nCommand: `python bench/engine_cpu.py`\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
