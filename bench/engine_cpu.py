"""CPU engine speed on the real demo models, beside llama.cpp's figures, as a ratio.

    python -m bench.engine_cpu [--threads 2] [--prompt-tokens 256] [--gen-tokens 64]
                               [--backends numpy,native] [--models smollm2,gemma3]
                               [--repeat N] [--against GIT_REF]

Each model and backend runs in its own process (so peak RSS is its own) with BLAS and OpenMP
limited to --threads. `numpy` is the float32 reference backend, `native` the compiled quantized
GEMV (`engine/backends/cpu_native.py`).
The llama.cpp reference (2 threads, this kind of 2-core machine) comes from issue 2.
`--against REF` also measures the engine as of git REF (a temporary worktree), alternating with
this checkout's runs, and prints this/REF ratios; `--repeat N` keeps each figure's median of N.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAMES = {"smollm2": "SmolLM2", "gemma3": "Gemma 3"}
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
    ap.add_argument("--repeat", type=int, default=1, help="runs per figure (median)")
    ap.add_argument("--against", help="git ref of a previous engine to measure in the same run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="numpy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.backend, args.prompt_tokens, args.gen_tokens)
        return 0
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "GENIE_THREADS"):
        env[var] = str(args.threads)
    base = None
    if args.against:
        base = Path(tempfile.mkdtemp(prefix="genie-bench-")) / "ref"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base), args.against],
            check=True,
        )
    lines = [
        f"# engine_cpu — {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{args.threads} threads, prompt {args.prompt_tokens}, decode {args.gen_tokens}, "
        f"median of {args.repeat}, load average {os.getloadavg()[0]:.2f} at start",
        "",
        "| model | backend | prefill tok/s | llama.cpp | ratio | decode tok/s | llama.cpp | ratio "
        "| peak RSS MiB | load s |"
        + (f" {args.against} prefill | {args.against} decode | this/ref prefill | this/ref decode |" if base else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if base else ""),
    ]

    def measure(name: str, backend: str, root: Path) -> dict:
        cmd = [
            sys.executable,
            str(root / "bench" / "engine_cpu.py"),
            "--child",
            name,
            "--backend",
            backend,
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--gen-tokens",
            str(args.gen_tokens),
        ]
        out = subprocess.run(
            cmd,
            env={**env, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            check=True,
            cwd=root,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    def median(rs: list[dict]) -> dict:
        return {k: statistics.median(r[k] for r in rs) for k in ("prefill_tps", "decode_tps", "peak_rss_mb", "load_s")}

    figures: dict[str, tuple[float, str]] = {}
    try:
        for name, backend in [(m, b) for m in args.models.split(",") for b in args.backends.split(",")]:
            mine, theirs = [], []
            for _ in range(args.repeat):  # alternate, so drift on a shared machine hits both alike
                mine.append(measure(name, backend, ROOT))
                if base:
                    theirs.append(measure(name, backend, base))
            r, ref = median(mine), LLAMA_CPP[name]
            row = (
                f"| {name} | {backend} | {r['prefill_tps']:.0f} | {ref['prefill_tps']:.0f} | "
                f"{r['prefill_tps'] / ref['prefill_tps']:.2f}x | {r['decode_tps']:.1f} | "
                f"{ref['decode_tps']:.0f} | {r['decode_tps'] / ref['decode_tps']:.2f}x | "
                f"{r['peak_rss_mb']:.0f} | {r['load_s']:.1f} |"
            )
            if base:
                o = median(theirs)
                row += (
                    f" {o['prefill_tps']:.0f} | {o['decode_tps']:.1f} | {r['prefill_tps'] / o['prefill_tps']:.2f}x "
                    f"| {r['decode_tps'] / o['decode_tps']:.2f}x |"
                )
            lines.append(row)
            if backend == "native":
                figures |= {
                    f"{name}.prefill_tok_s": (round(r["prefill_tps"]), "tok/s"),
                    f"{name}.prefill_vs_llama_cpp": (round(r["prefill_tps"] / ref["prefill_tps"], 2), "x"),
                    f"{name}.decode_tok_s": (round(r["decode_tps"], 1), "tok/s"),
                    f"{name}.decode_vs_llama_cpp": (round(r["decode_tps"] / ref["decode_tps"], 2), "x"),
                    f"{name}.peak_rss_mib": (round(r["peak_rss_mb"]), "MiB"),
                }
                if base:
                    figures[f"{name}.prefill_vs_ref"] = (round(r["prefill_tps"] / o["prefill_tps"], 2), "x")
                    figures[f"{name}.decode_vs_ref"] = (round(r["decode_tps"] / o["decode_tps"], 2), "x")
    finally:
        if base:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    lines.append(f"\nload average at end: {os.getloadavg()[0]:.2f} (other work on the machine skews this)")
    text = "\n".join(lines)
    print(text)
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "engine_cpu.md").write_text(text + f"\n\nCommand: `python {' '.join(sys.argv)}`\n")
    models = [m for m in args.models.split(",") if f"{m}.decode_tok_s" in figures]
    if models:
        sys.path.insert(0, str(ROOT))  # also when run as `python bench/engine_cpu.py`
        from bench.record import record

        record(
            "engine_cpu",
            results / "engine_cpu.md",
            figures,
            reference="llama.cpp's figures for this kind of 2-core machine (issue 2)"
            + (f"; {args.against} in the same run" if base else ""),
            headline="native CPU engine vs llama.cpp: "
            + "; ".join(
                f"{MODEL_NAMES.get(m, m)} decode {figures[m + '.decode_vs_llama_cpp'][0]:.2f}x, "
                f"prefill {figures[m + '.prefill_vs_llama_cpp'][0]:.2f}x"
                for m in models
            ),
            command="`make bench-engine` (`python -m bench.engine_cpu`)",
            details={
                "backend": "native",
                "runs": f"median of {args.repeat}" if args.repeat > 1 else "one run",
                "models": ",".join(models),
                **({"against": args.against} if base else {}),
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
