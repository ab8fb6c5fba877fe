"""The command line shared by the benchmarks that measure a CPU part (SmolLM2) and a GPU part (a synthetic
model on the device) in one run and write their rows as `<name>-<date>-<cpu|gpu|all>.md` + `.json`.

    ap = argparse.ArgumentParser(...); ap.add_argument(...)  # the bench's own options
    a = cpu_gpu.parse(ap, workdir="where the synthetic GPU model goes (temp dir)")
    if cpu_gpu.replayed(a, _record): return 0
    ...
    out = _write(rows, cpu_gpu.result_path(a, "constrained"), ...)
    cpu_gpu.save(out, rows, _record)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

Record = Callable[[Path, list[dict[str, Any]]], None]
"""A bench's recorder: its result file and rows into bench/results/index.json."""


def parse(ap: argparse.ArgumentParser, workdir: str) -> argparse.Namespace:
    """Add the shared options (threads, which part, where results and work files go, --record) and parse."""
    ap.add_argument("--threads", type=int, default=None, help="CPU threads of the native kernels (default: all)")
    ap.add_argument("--cpu-only", action="store_true")
    ap.add_argument("--gpu-only", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--workdir", default=None, help=workdir)
    ap.add_argument("--record", default=None, help="record the rows of an earlier run's .json (no benchmark run)")
    return ap.parse_args()


def replayed(a: argparse.Namespace, record: Record) -> bool:
    """With --record, record that earlier run's rows (its .md beside the .json) and say so; else False."""
    if not a.record:
        return False
    rows_path = Path(a.record)
    record(rows_path.with_suffix(".md"), json.loads(rows_path.read_text(encoding="utf-8")))
    return True


def result_path(a: argparse.Namespace, name: str) -> Path:
    """Where this run's table goes: `<out>/<name>-<date>-<gpu|cpu|all>.md` (the folder made)."""
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "gpu" if a.gpu_only else "cpu" if a.cpu_only else "all"
    return out_dir / f"{name}-{time.strftime('%Y%m%d')}-{suffix}.md"


@contextmanager
def synthetic_gpu_model(workdir: str | None, **load: Any) -> Iterator[tuple[Any, str] | None]:
    """The GPU part's model: the Qwen3-4B-shaped synthetic GGUF (`qwen3-4b-q4_k_m`, fast) written into
    a temporary folder under `workdir` and loaded on the CUDA backend with `load` (n_ctx, kv_dtype),
    as (model, folder), closed on exit; None, after printing why, where CUDA is not usable."""
    try:
        from engine.backends import cuda_available

        ok, why = cuda_available()
    except ImportError as exc:
        ok, why = False, str(exc)
    if not ok:
        print(f"GPU part skipped: {why}", flush=True)
        yield None
        return
    from engine import load_model
    from engine.synth import preset_config, write_config

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = os.path.join(tmp, "qwen3-4b.gguf")
        write_config(path, preset_config("qwen3-4b-q4_k_m", fast=True))
        model = load_model(path, backend="cupy", **load)
        try:
            yield model, tmp
        finally:
            model.close()


def save(out: Path, rows: list[dict[str, Any]], record: Record) -> None:
    """Write the rows as `out`'s .json beside the table, say so and record them."""
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out} and its .json")
    record(out, rows)


def record_rows(
    name: str, out: Path, rows: list[dict[str, Any]], figures: dict[str, Any], *, reference: str, headline: str
) -> None:
    """Record a run's rows under `name` (one backend's run under `<name>_<backend>`, so a CPU run and a
    GPU run of the same day both stay in the index); nothing when bench.record cannot be imported."""
    try:
        from bench.record import record
    except ImportError:
        return
    backends = sorted({r["backend"] for r in rows})
    record(
        name,
        out,
        figures,
        reference=reference,
        headline=headline,
        command=f"`python -m bench.{name}`",
        entry=name if len(backends) > 1 else f"{name}_{backends[0]}",
    )
