"""The docs' speed figures come from bench/results/index.json: blocks match it, cited files exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import index as bench_index
from bench.record import INDEX, RESULTS, ROOT, load, record


@pytest.mark.timeout(30)
def test_docs_blocks_equal_what_the_index_renders() -> None:
    """Every marked block in the docs holds exactly the index's rendering (a hand edit or a stale block fails)."""
    assert bench_index.stale() == [], "run: python -m bench.index --write"


@pytest.mark.timeout(30)
def test_every_entry_is_rendered_somewhere_and_every_block_names_an_entry() -> None:
    """Each doc the index says cites an entry has blocks, and every block renders (names an entry or a renderer)."""
    names = set()
    for doc in bench_index.DOCS:
        for m in bench_index.BLOCK.finditer((ROOT / doc).read_text(encoding="utf-8")):
            bench_index.render(m.group(2), load())
            names.add(m.group(2))
    assert {"results-index", "readme-speed", "engine_cpu-table"} <= names


@pytest.mark.timeout(30)
def test_every_file_the_index_cites_exists() -> None:
    """Each entry's result file or folder is in bench/results/, and each doc it is cited by exists."""
    entries = load()
    assert entries
    for name, e in entries.items():
        if e["result"] is not None:
            assert (RESULTS / e["result"]).exists(), f"{name}: bench/results/{e['result']} is missing"
        for doc in e["cited_by"]:
            assert (ROOT / doc).exists(), f"{name}: cited by {doc}, which does not exist"
        for fig in e["figures"].values():
            assert isinstance(fig["value"], (int, float)) and isinstance(fig["unit"], str)


@pytest.mark.timeout(30)
def test_record_replaces_the_entry_and_keeps_its_citations(tmp_path: Path) -> None:
    """record() stores a run as the bench's entry, relative to the results folder, keeping who cites it;
    a run written outside the results folder is not recorded."""
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"entries": {"gate": {**load(INDEX)["gate"]}}}), encoding="utf-8")
    (tmp_path / "gate-new.md").write_text("x", encoding="utf-8")
    e = record(
        "gate",
        tmp_path / "gate-new.md",
        {"pause_reaction_p99_ms": (12.0, "ms")},
        reference="no gate, same run",
        headline="p99 12.0 ms",
        command="make bench-gate",
        index=index,
    )
    assert (
        e is not None
        and e["result"] == "gate-new.md"
        and e["figures"] == {"pause_reaction_p99_ms": {"value": 12.0, "unit": "ms"}}
    )
    assert e["cited_by"] == ["docs/benchmarks.md"] and load(index)["gate"] == e
    outside = record("gate", tmp_path.parent / "x.md", {}, reference="", headline="", command="", index=index)
    assert outside is None and load(index)["gate"] == e
    text = bench_index.regenerate("a <!-- bench:gate -->old<!-- /bench:gate --> b", load(index))
    assert text == "a <!-- bench:gate -->\nLatest (`bench/results/gate-new.md`): p99 12.0 ms.\n<!-- /bench:gate --> b"
