"""Constrained decoding's cost: decode tokens/s through Model.generate with and without a JSON
schema constraint, same model, same prompt, same sampling, in one run.

    python -m bench.constrained [--runs 3] [--tokens 96] [--cpu-only] [--gpu-only] [--out DIR]
    python -m bench.constrained --record bench/results/constrained-<date>-gpu.json   # a run made elsewhere

CPU: the real SmolLM2 model (native kernels). GPU (when CuPy imports and a device works): a
synthetic Qwen3-4B Q4_K_M shape (`engine.synth`, random weights, 151,936-token byte-level
vocabulary). The schema is an open-ended array of small objects, so both runs decode the same
number of tokens (`--tokens`); greedy and sampled (the default sampling) each. Prints the ratio
constrained / plain (median of --runs, the two alternating) and the mask's own time per token
(llguidance's `fill`; on the GPU it overlaps the step's forward pass). Writes
bench/results/constrained-<date>-<cpu|gpu|all>.md (and .json, the rows) and records the figures
in the results index (`--record` records a .json brought back from the device machine).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio

from bench import cpu_gpu
from engine import Grammar, SamplingParams, TemplateError, load_model

ROOT = Path(__file__).resolve().parents[1]
SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 16,  # a random synthetic model would close the array at once: 16 objects outlast --tokens 96
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Berlin", "Madrid", "Rome", "Lisbon"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}
PROMPT = "List many people as a JSON array of objects with name, age and city."
MODES: dict[str, dict[str, Any]] = {"greedy": {"temperature": 0.0}, "sampled": {}}


def _decode(model: Any, ids: list[int], params: SamplingParams, grammar: Grammar | None) -> dict[str, float]:
    """One generation: decode tok/s (n - 1 steps), tokens, mask time per token."""

    async def run() -> dict[str, float]:
        constraint = model.constrainer.start(grammar) if grammar is not None else None
        gen = model.generate(ids, params, constraint=constraint)
        async for _ in gen:
            pass
        masks = constraint.masks if constraint is not None else 0
        return {
            "tok_s": gen.stats.decode_tps,
            "tokens": float(gen.stats.completion_tokens),
            "mask_ms": 1e3 * constraint.mask_s / masks if constraint is not None and masks else 0.0,
        }

    return anyio.run(run)


def bench(model: Any, label: str, tokens: int, runs: int) -> list[dict[str, Any]]:
    """Plain and constrained decode on `model`, greedy and sampled, alternating runs."""
    grammar = Grammar.json_schema(SCHEMA)
    t0 = time.perf_counter()
    model.constrainer.check(grammar)  # builds llguidance's vocabulary once
    vocab_s = time.perf_counter() - t0
    try:
        ids = model.encode_chat([{"role": "user", "content": PROMPT}])
    except TemplateError:  # a synthetic model without a chat template
        ids = model.tokenizer.encode(PROMPT)
    rows = []
    for mode, extra in MODES.items():
        params = SamplingParams(**{"max_tokens": tokens, "ignore_eos": True, "seed": 1, **extra})
        _decode(model, ids, params, grammar)  # warm: graphs, lexer states, prefix cache
        _decode(model, ids, params, None)
        plain, constrained = [], []
        for _ in range(runs):
            plain.append(_decode(model, ids, params, None))
            constrained.append(_decode(model, ids, params, grammar))
        p = statistics.median(r["tok_s"] for r in plain)
        c = statistics.median(r["tok_s"] for r in constrained)
        row = {
            "model": label,
            "backend": model.backend,
            "mode": mode,
            "plain_tok_s": round(p, 1),
            "constrained_tok_s": round(c, 1),
            "ratio": round(c / p, 3) if p else 0.0,
            "mask_ms": round(statistics.median(r["mask_ms"] for r in constrained), 3),
            "constrained_tokens": int(statistics.median(r["tokens"] for r in constrained)),
            "vocab_build_s": round(vocab_s, 2),
        }
        print(
            f"{label} ({model.backend}) {mode}: plain {p:.1f} tok/s, constrained {c:.1f} tok/s "
            f"({row['ratio']:.3f}x; {row['constrained_tokens']} tokens), mask {row['mask_ms']:.3f} ms/token",
            flush=True,
        )
        rows.append(row)
    return rows


def _gpu_rows(tokens: int, runs: int, workdir: str | None) -> list[dict[str, Any]]:
    with cpu_gpu.synthetic_gpu_model(workdir, n_ctx=1024) as got:
        return [] if got is None else bench(got[0], "qwen3-4b (synthetic)", tokens, runs)


def _write(rows: list[dict[str, Any]], out: Path, command: str, load: str) -> Path:
    lines = [
        f"# Constrained decoding cost ({time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, {os.cpu_count()} cores)",
        "",
        f"`{command}`: decode tok/s through Model.generate, plain vs a JSON-schema constraint (an open-ended "
        "array of objects), same model, prompt and sampling; median of alternating runs; mask = llguidance's "
        "`fill` per token (the CPU path computes it in a worker thread during the forward pass, the GPU path "
        f"on the host while the step runs on the device). Load average {load} (other work on the machine skews "
        "CPU figures).",
        "",
        "| model | backend | mode | plain tok/s | constrained tok/s | ratio | mask ms/token | vocab build s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['backend']} | {r['mode']} | {r['plain_tok_s']} | {r['constrained_tok_s']} | "
            f"{r['ratio']:.3f} | {r['mask_ms']:.3f} | {r['vocab_build_s']} |"
        )
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96, help="tokens decoded per run")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per case (median)")
    a = cpu_gpu.parse(ap, workdir="where the synthetic GPU model goes (temp dir)")
    if cpu_gpu.replayed(a, _record):
        return 0
    rows: list[dict[str, Any]] = []
    if not a.gpu_only:
        from tests.models import SMOLLM2

        if not SMOLLM2.exists():
            print(f"CPU part skipped: {SMOLLM2} missing (genie-supervisor models fetch)", flush=True)
        else:
            model = load_model(str(SMOLLM2), backend="auto", threads=a.threads)
            label = "smollm2-135m-q4_1" + (f" ({a.threads} thread{'s' if a.threads > 1 else ''})" if a.threads else "")
            rows += bench(model, label, a.tokens, a.runs)
    if not a.cpu_only:
        rows += _gpu_rows(a.tokens, a.runs, a.workdir)
    if not rows:
        return 1
    command = "python -m bench.constrained " + " ".join(sys.argv[1:])
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    out = _write(rows, cpu_gpu.result_path(a, "constrained"), command.strip(), load)
    cpu_gpu.save(out, rows, _record)
    return 0


def _record(out: Path, rows: list[dict[str, Any]]) -> None:
    figures = {
        f"{r['backend']}.{r['mode']}.{k}": (r[k], u)
        for r in rows
        for k, u in (("ratio", "x"), ("mask_ms", "ms"), ("constrained_tok_s", "tok/s"))
    }
    headline = "; ".join(
        f"{r['model']} {r['backend']} {r['mode']} {r['ratio']:.2f}x of plain decode ({r['mask_ms']:.2f} ms mask/token)"
        for r in rows
    )
    cpu_gpu.record_rows(
        "constrained",
        out,
        rows,
        figures,
        reference="plain decode, same model, prompt and sampling, same run",
        headline=f"JSON-schema constrained decode: {headline}",
    )


if __name__ == "__main__":
    raise SystemExit(main())
