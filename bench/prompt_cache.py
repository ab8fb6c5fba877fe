"""Time to first token with a ~2,000-token system prompt, cold vs restored from the prompt cache on disk.

    python -m bench.prompt_cache [--runs 3] [--cpu-runs 1] [--cpu-only] [--gpu-only] [--kv f16|int8] [--out DIR]
    python -m bench.prompt_cache --record bench/results/prompt_cache-<date>-gpu.json   # a run made elsewhere

A Home Assistant-like system prompt (an entity list, ~2,000 tokens) and a short question, through
Model.generate (one token, greedy), in one run per model:
- cold: the KV cache empty, no prompt cache: the whole prompt is prefilled;
- then the system prompt's K/V is saved (`ModelCache.offer`, the file's size and write time shown);
- restored: a new store attached as after a restart (key and index read from disk), the KV cache
  empty again: the prefix comes from the file (read, checked, copied into the KV buffers) and
  only the question is prefilled; once with the file in the page cache and once evicted from it
  (``posix_fadvise DONTNEED``, that file only), and once with the gate checked between groups of
  4 layers (the shipped policies' `prefill_layer_group`); the first restored run is shown alone
  (on a GPU it captures the question's later-chunk graphs, `cupy_prefill_graph`).
Prints the medians and restored / cold (the target: <= 0.20). CPU: the real SmolLM2 (native kernels);
GPU (CuPy and a device): a synthetic Qwen3-4B Q4_K_M shape. Writes
bench/results/prompt_cache-<date>-<cpu|gpu|all>.md (and .json) and records the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from bench import cpu_gpu
from engine import Model, SamplingParams, load_model
from engine.prompt_cache import ModelCache, PromptCache

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Turn off the hall light and tell me which lights are still on."
GROUP = 4
"""Layers per prefill piece in the grouped restored runs (the shipped policies' prefill_layer_group)."""
AREAS = ("kitchen", "hall", "living room", "bedroom", "garage", "office", "porch", "bathroom")


def entity_list(n: int) -> str:
    """A Home Assistant-style system prompt exposing `n` light entities."""
    lines = ["You are a voice assistant for Home Assistant. Answer in one sentence. Exposed entities:"]
    for i in range(n):
        area = AREAS[i % len(AREAS)]
        lines.append(f"- light.{area.replace(' ', '_')}_{i}: '{area} lamp {i}' state on, brightness {(i * 37) % 100}%")
    return "\n".join(lines)


def sized_entity_list(size: Callable[[str], int], tokens: int) -> str:
    """The longest `entity_list` of at most `tokens` tokens as `size` counts them."""
    lo, hi = 1, 2
    while size(entity_list(hi)) <= tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # size(lo) <= tokens < size(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(entity_list(mid)) <= tokens else (lo, mid)
    return entity_list(lo)


def system_prompt(model: Model, tokens: int) -> list[dict[str, str]]:
    """Messages: a system prompt of at most `tokens` tokens, as many as fit (exposed entities, HA
    style), and the question."""

    def size(text: str) -> int:
        return len(model.encode_chat([{"role": "system", "content": text}]))

    return [{"role": "system", "content": sized_entity_list(size, tokens)}, {"role": "user", "content": QUESTION}]


def _ttft(model: Model, ids: list[int], cache: ModelCache | None, group: int = 0) -> tuple[float, int, int]:
    """One generation from an empty KV cache: (seconds to the first token, its id, tokens from
    disk); `group`: the gate checked between groups of that many layers (the policies' 4)."""
    model.with_kv(lambda kv: kv.tokens.clear())

    async def run() -> tuple[float, int, int]:
        gen = model.generate(
            ids, SamplingParams(max_tokens=1, temperature=0), prompt_cache=cache, prefill_layer_group=group
        )
        first = [t.id async for t in gen][0]
        return gen.stats.first_token_s or 0.0, first, gen.stats.disk_tokens

    return anyio.run(run)


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench(model: Model, label: str, tokens: int, runs: int, workdir: str) -> dict[str, Any]:
    """Cold and restored TTFT on `model` (module doc)."""
    msgs = system_prompt(model, tokens)
    ids = model.encode_chat(msgs)
    _ttft(model, model.encode_chat([{"role": "user", "content": "Hi"}]), None)  # warm: kernels, graphs
    cold = [_ttft(model, ids, None) for _ in range(runs)]
    events: list[tuple[str, dict[str, Any]]] = []
    store = PromptCache(Path(workdir) / "pc", 8 << 30, 256, on_event=lambda n, f: events.append((n, f)))
    cache = store.attach(model)
    assert cache.wait_ready(120), cache.error
    stable = cache.stable_prefix(msgs, None, ids)
    assert cache.offer(ids[:stable]), "the prefix was not saved"
    assert store.flush(120)
    saved = next(f for n, f in events if n == "prompt_cache_saved")

    t0 = time.perf_counter()
    restart = PromptCache(Path(workdir) / "pc", 8 << 30, 256, on_event=lambda n, f: events.append((n, f)))
    cache = restart.attach(model)
    assert cache.wait_ready(120), cache.error
    attach_s = time.perf_counter() - t0
    (entry,) = cache.entries
    warm = [_ttft(model, ids, cache) for _ in range(runs)]
    grouped = [_ttft(model, ids, cache, GROUP) for _ in range(runs)]
    warm_restores = [f for n, f in events if n == "prompt_cache_restored"]
    evicted = []
    for _ in range(runs):
        _evict(entry.path)
        evicted.append(_ttft(model, ids, cache))
    assert all(r[2] == stable for r in warm + grouped + evicted), "a restore did not come from disk"
    restores = [f for n, f in events if n == "prompt_cache_restored"][len(warm_restores) :]

    def med(rs: list[dict[str, Any]], k: str) -> float:
        return round(statistics.median(r[k] for r in rs), 1)

    c, w, g, e = (statistics.median(r[0] for r in rs) for rs in (cold, warm, grouped, evicted))
    row = {
        "model": label,
        "backend": model.backend,
        "kv": model.transformer.kv.dtype,
        "prompt_tokens": len(ids),
        "cached_tokens": stable,
        "cold_ms": round(c * 1e3, 1),
        "restored_ms": round(w * 1e3, 1),
        "restored_evicted_ms": round(e * 1e3, 1),
        "restored_first_ms": round(warm[0][0] * 1e3, 1),
        "restored_groups_ms": round(g * 1e3, 1),
        "ratio": round(w / c, 4),
        "ratio_groups": round(g / c, 4),
        "ratio_evicted": round(e / c, 4),
        "restore_ms": med(warm_restores, "ms"),
        "restore_read_wait_ms": med(warm_restores, "read_wait_ms"),
        "restore_copy_ms": med(warm_restores, "copy_ms"),
        "restore_evicted_ms": med(restores, "ms"),
        "restore_first_ms": warm_restores[0]["ms"],
        "file_mb": round(saved["bytes"] / 2**20, 1),
        "save_ms": saved["ms"],
        "attach_s": round(attach_s, 2),
        "same_token": len({r[1] for r in cold + warm + grouped + evicted}) == 1,
        "runs": runs,
    }
    print(
        f"{label} ({model.backend}, {row['kv']} KV): {len(ids)} prompt tokens, {stable} from the cache; "
        f"TTFT cold {row['cold_ms']} ms, restored {row['restored_ms']} ms ({row['ratio']:.3f}x; "
        f"first restored run {row['restored_first_ms']} ms, its restore {row['restore_first_ms']} ms; "
        f"in groups of {GROUP} layers "
        f"{row['restored_groups_ms']} ms, {row['ratio_groups']:.3f}x), "
        f"file out of the page cache {row['restored_evicted_ms']} ms ({row['ratio_evicted']:.3f}x); "
        f"file {row['file_mb']} MiB written in {row['save_ms']} ms, restore {row['restore_ms']} ms "
        f"(waiting for reads {row['restore_read_wait_ms']} ms, copies {row['restore_copy_ms']} ms; "
        f"{row['restore_evicted_ms']} ms out of the page cache)",
        flush=True,
    )
    return row


def _gpu_row(tokens: int, runs: int, kv: str, workdir: str | None) -> list[dict[str, Any]]:
    with cpu_gpu.synthetic_gpu_model(workdir, n_ctx=tokens + 512, kv_dtype=kv) as got:
        return [] if got is None else [bench(got[0], "qwen3-4b-q4_k_m (synthetic)", tokens, runs, got[1])]


def _write(rows: list[dict[str, Any]], out: Path, command: str) -> Path:
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    lines = [
        f"# Prompt cache on disk: time to first token ({time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, "
        f"{os.cpu_count()} cores)",
        "",
        f"`{command}`: a ~2,000-token system prompt + a short question, one greedy token through Model.generate "
        "from an empty KV cache; cold = whole prompt prefilled, restored = the system prompt's K/V read from its "
        "cache file (a new store attached as after a restart; checked: CRC-32 on the host, the device checksum on a "
        "GPU; copied into the KV buffers) and the "
        "question prefilled; 'first' = the first restored run alone (on the GPU the question's chunk graphs are "
        f"captured in it); 'groups' = the gate checked between groups of {GROUP} layers, as the shipped policies do; "
        "'evicted' = the file dropped from the page cache first. Medians; restored / cold in "
        f"the same run. Load average {load}.",
        "",
        "| model | backend | KV | prompt | from cache | cold ms | restored ms | ratio | first ms | groups ms "
        "| ratio | evicted ms | ratio | restore ms (warm / evicted) | file MiB | write ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['backend']} | {r['kv']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
            f"{r['cold_ms']} | {r['restored_ms']} | {r['ratio']:.3f} | {r.get('restored_first_ms', '-')} | "
            f"{r.get('restored_groups_ms', '-')} | {r.get('ratio_groups', 0):.3f} | {r['restored_evicted_ms']} | "
            f"{r['ratio_evicted']:.3f} | {r['restore_ms']} / {r.get('restore_evicted_ms', '-')} | {r['file_mb']} | {r['save_ms']} |"
        )
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="system prompt length (tokens)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per case on the GPU (median)")
    ap.add_argument("--cpu-runs", type=int, default=1, help="timed runs per case on the CPU (a cold run is long)")
    ap.add_argument("--kv", choices=("f16", "int8"), default="f16", help="KV cache element type")
    a = cpu_gpu.parse(ap, workdir="where the model and cache files go (a temp dir)")
    if cpu_gpu.replayed(a, _record):
        return 0
    rows: list[dict[str, Any]] = []
    if not a.gpu_only:
        from tests.models import SMOLLM2

        if not SMOLLM2.exists():
            print(f"CPU part skipped: {SMOLLM2} missing (genie-supervisor models fetch)", flush=True)
        else:
            model = load_model(str(SMOLLM2), backend="auto", threads=a.threads, n_ctx=a.tokens + 512, kv_dtype=a.kv)
            with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
                rows.append(bench(model, "smollm2-135m-q4_1", a.tokens, a.cpu_runs, tmp))
    if not a.cpu_only:
        rows += _gpu_row(a.tokens, a.runs, a.kv, a.workdir)
    if not rows:
        return 1
    command = ("python -m bench.prompt_cache " + " ".join(sys.argv[1:])).strip()
    out = _write(rows, cpu_gpu.result_path(a, "prompt_cache"), command)
    cpu_gpu.save(out, rows, _record)
    return 0


def _record(out: Path, rows: list[dict[str, Any]]) -> None:
    figures = {
        f"{r['backend']}.{k}": (r[k], u)
        for r in rows
        for k, u in (("ratio", "x"), ("cold_ms", "ms"), ("restored_ms", "ms"), ("file_mb", "MiB"))
    }
    headline = "; ".join(
        f"{r['model']} {r['backend']} {r['kv']} KV: TTFT {r['cold_ms']:.0f} ms cold, {r['restored_ms']:.0f} ms restored "
        f"({r['ratio']:.3f}x; {r['restored_evicted_ms']:.0f} ms with the file out of the page cache), "
        f"{r['file_mb']} MiB file"
        for r in rows
    )
    cpu_gpu.record_rows(
        "prompt_cache",
        out,
        rows,
        figures,
        reference="cold prefill of the same prompt, same model, same run",
        headline=f"Prompt cache on disk, ~2,000-token system prompt: {headline}",
    )


if __name__ == "__main__":
    raise SystemExit(main())
