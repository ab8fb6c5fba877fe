"""What each benchmark calls at its end: its headline figures go into bench/results/index.json.

    from bench.record import record
    record("gate", "gate.md", {"decode_gate_ratio": (1.002, "x")}, reference="no gate, same run",
           headline="...", command="make bench-gate")

The index keeps, per entry, the latest result of one benchmark (the entry named after it) and the
older results the docs cite (entries under other names). After the update the marked blocks of the
docs are regenerated from it (bench/index.py), so a speed figure is written in one place.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "index.json"


def load(index: Path = INDEX) -> dict[str, dict[str, Any]]:
    """The index's entries by name, in file order (empty when there is no index yet)."""
    if not index.exists():
        return {}
    entries: dict[str, dict[str, Any]] = json.loads(index.read_text(encoding="utf-8"))["entries"]
    return entries


def save(entries: dict[str, dict[str, Any]], index: Path = INDEX) -> None:
    """Write the entries back, one stable layout so the diff of a run is its figures."""
    index.write_text(json.dumps({"entries": entries}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def result_file(folder: str | Path, name: str, tag: str = "", suffix: str = ".md") -> Path:
    """`folder/<name>-<YYYYmmdd-HHMMSS>[-<tag>]<suffix>`, the folder made: where a run writes its result."""
    stamp = time.strftime("%Y%m%d-%H%M%S") + (f"-{tag}" if tag else "")
    out = Path(folder) / f"{name}-{stamp}{suffix}"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def commit() -> str:
    """This checkout's short commit, with `-dirty` when tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")


def record(
    name: str,
    result: str | Path,
    figures: dict[str, tuple[float, str]],
    *,
    reference: str,
    headline: str,
    command: str,
    details: dict[str, str] | None = None,
    entry: str | None = None,
    index: Path = INDEX,
    write_docs: bool = True,
) -> dict[str, Any] | None:
    """Store one benchmark's result as the entry `entry` (default: `name`, its latest) and regenerate the docs.

    `result` is the result file or folder, under bench/results/ (a relative path is taken from the
    working directory); a result elsewhere is not recorded (None). `figures` maps a figure's name to (value, unit); `reference` is what the ratios are against;
    `headline` is the one-line reading of the figures that the docs show; `details` are settings a
    renderer needs (e.g. engine_cpu's `against`, `runs`, `models`).
    """
    path = Path(result)
    try:
        path = path.resolve().relative_to(index.parent.resolve())
    except ValueError:  # a run written elsewhere (--out /tmp/x, a test) is not the benchmark's result
        print(f"bench index: {name} not recorded, {result} is outside {index.parent}", flush=True)
        return None
    entries = load(index)
    key = entry or name
    old = entries.get(key, {})
    entries[key] = {
        "bench": name,
        "command": command,
        "result": path.as_posix(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "reference": reference,
        "headline": headline,
        "figures": {k: {"value": v, "unit": u} for k, (v, u) in figures.items()},
        "cited_by": old.get("cited_by", []),
    }
    if details:
        entries[key]["details"] = details
    save(entries, index)
    if write_docs and index == INDEX:
        from bench.index import write

        changed = write()
        print(f"bench index: {key} recorded; regenerated {', '.join(changed) or 'nothing'}", flush=True)
    return entries[key]
