"""The docs' speed figures, rendered from bench/results/index.json into their marked blocks.

    python -m bench.index            # exit 1 and name the stale blocks, if any
    python -m bench.index --write    # regenerate every block

A block is `<!-- bench:NAME -->` ... `<!-- /bench:NAME -->` in one of DOCS (inline or over lines).
NAME is an index entry (rendered as its latest-result line) or one of RENDERERS. Benches update
the index through bench/record.py, which calls write().
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.record import INDEX, ROOT, load

DOCS = ("README.md", "docs/benchmarks.md", "docs/ui.md", "bench/results/README.md")
BLOCK = re.compile(r"(<!-- bench:([\w.-]+) -->)(.*?)(<!-- /bench:\2 -->)", re.S)
MODELS = {"smollm2": "SmolLM2-135M Q4_1", "gemma3": "Gemma-3-270M Q4_K_M"}

Entries = dict[str, dict[str, Any]]


def value(entry: dict[str, Any], figure: str) -> float:
    """One figure's value; a KeyError names the entry's bench and the figure."""
    try:
        return float(entry["figures"][figure]["value"])
    except KeyError:
        raise KeyError(f"{entry['bench']}: no figure {figure!r} in the index") from None


def latest_line(entry: dict[str, Any]) -> str:
    """The one-line form, on a line of its own between the markers: result file and headline."""
    return f"\nLatest (`bench/results/{entry['result']}`): {entry['headline']}.\n"


def results_table(entries: Entries) -> str:
    """bench/results/README.md's table: one row per entry."""
    rows = ["| benchmark | result | what it says (headline) | commit, date | cited by |", "|---|---|---|---|---|"]
    for e in entries.values():
        cited, result = ", ".join(e["cited_by"]), f"`{e['result']}`" if e["result"] else "(no file kept)"
        rows.append(f"| {e['command']} | {result} | {e['headline']} | {e['commit']}, {e['date']} | {cited} |")
    return "\n" + "\n".join(rows) + "\n"


def engine_cpu_table(entries: Entries) -> str:
    """docs/benchmarks.md's CPU engine table: per model, tokens/s and ratios to llama.cpp and the git ref."""
    e = entries["engine_cpu"]
    d = e.get("details", {})
    ref = d.get("against")
    head = f"Latest (`bench/results/{e['result']}`; {d.get('backend', 'native')} backend, {d.get('runs', 'one run')}"
    head += f", against {ref}{d.get('against_note', '')}):" if ref else "):"
    cols = "| model | prefill tok/s | vs llama.cpp | decode tok/s | vs llama.cpp | peak RSS |"
    cols += f" vs {ref} prefill / decode |" if ref else ""
    rows = [head, "", cols, "|---" * cols.count(" | ") + "|---|"]
    for m in d.get("models", "smollm2,gemma3").split(","):
        row = (
            f"| {MODELS.get(m, m)} | {value(e, m + '.prefill_tok_s'):.0f} | {value(e, m + '.prefill_vs_llama_cpp'):.2f}x"
            f" | {value(e, m + '.decode_tok_s'):.1f} | {value(e, m + '.decode_vs_llama_cpp'):.2f}x"
            f" | {value(e, m + '.peak_rss_mib'):.0f} MiB |"
        )
        if ref:
            row += f" {value(e, m + '.prefill_vs_ref'):.2f}x / {value(e, m + '.decode_vs_ref'):.2f}x |"
        rows.append(row)
    return "\n" + "\n".join(rows) + "\n"


RENDERERS: dict[str, Callable[[Entries], str]] = {
    "results-index": results_table,
    "engine_cpu-table": engine_cpu_table,
    "readme-speed": lambda entries: str(entries["engine_gpu_generate"]["headline"]),
}


def render(name: str, entries: Entries) -> str:
    """The text a block NAME holds between its markers (a block that starts a line holds whole lines:
    Markdown ends a comment's HTML block at the end of its line)."""
    if name in RENDERERS:
        return RENDERERS[name](entries)
    if name not in entries:
        raise KeyError(f"block bench:{name} names no index entry and no renderer")
    return latest_line(entries[name])


def regenerate(text: str, entries: Entries) -> str:
    """`text` with every marked block replaced by its rendering."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), entries) + m.group(4), text)


def write(root: Path = ROOT, index: Path = INDEX) -> list[str]:
    """Regenerate the blocks of every doc; the docs that changed."""
    entries, changed = load(index), []
    for doc in DOCS:
        path = root / doc
        text = path.read_text(encoding="utf-8")
        new = regenerate(text, entries)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(doc)
    return changed


def stale(root: Path = ROOT, index: Path = INDEX) -> list[str]:
    """`doc: bench:NAME` for every block whose text is not what the index renders."""
    entries, out = load(index), []
    for doc in DOCS:
        for m in BLOCK.finditer((root / doc).read_text(encoding="utf-8")):
            if m.group(3) != render(m.group(2), entries):
                out.append(f"{doc}: bench:{m.group(2)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate the blocks (default: check them)")
    a = ap.parse_args(argv)
    if a.write:
        print("\n".join(write()) or "all blocks up to date")
        return 0
    bad = stale()
    print("\n".join(f"{b}: stale, run python -m bench.index --write" for b in bad) or "all blocks up to date")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
