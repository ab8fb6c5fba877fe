"""bench.llama_bench runs a llama-bench binary the way bench.engine_gpu --llama-bench needs it: pp<prompt>
and tg<decode> at depth <prompt>, every layer on the GPU, flash attention, JSON out; and falls back to
depth 0 with a binary that has no -d. The binary is a stand-in script printing llama-bench's JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import llama_bench

pytestmark = pytest.mark.timeout(60)

FAKE = """#!{python}
import json, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if {no_depth} and "-d" in args:
    print("error: invalid parameter for argument: -d", file=sys.stderr)
    sys.exit(1)
p, n = int(args[args.index("-p") + 1]), int(args[args.index("-n") + 1])
ts = 45000.0 if n == 0 else 877.0
print(json.dumps([{{"build_commit": "0c1e570", "n_prompt": p, "n_gen": n, "avg_ts": ts}}]))
"""


def _fake(tmp_path: Path, no_depth: bool) -> tuple[str, Path]:
    log = tmp_path / "calls.jsonl"
    exe = tmp_path / "llama-bench"
    exe.write_text(FAKE.format(python=sys.executable, log=str(log), no_depth=no_depth))
    exe.chmod(0o755)
    return str(exe), log


def test_measure_runs_prompt_and_decode_at_depth(tmp_path: Path) -> None:
    """pp512 alone and tg128 at depth 512, all layers on the GPU with flash attention; the figures
    are llama-bench's mean tokens/s."""
    exe, log = _fake(tmp_path, no_depth=False)
    got = llama_bench.measure(exe, "/m.gguf", 512, 128, reps=2)
    assert got == {"prefill": 45000.0, "decode": 877.0, "decode_depth": 512, "build": "0c1e570"}
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    common = ["-m", "/m.gguf", "-ngl", "99", "-fa", "1", "-r", "2"]
    assert calls == [
        [*common, "-p", "512", "-n", "0", "-o", "json"],
        [*common, "-p", "0", "-n", "128", "-d", "512", "-o", "json"],
    ]


def test_a_binary_without_depth_decodes_at_depth_zero_and_says_so(tmp_path: Path) -> None:
    """An older llama-bench that refuses -d is run again without it; the result's depth is 0."""
    exe, log = _fake(tmp_path, no_depth=True)
    got = llama_bench.measure(exe, "/m.gguf", 512, 128)
    assert got["decode"] == 877.0 and got["decode_depth"] == 0
    assert "-d" not in json.loads(log.read_text().splitlines()[-1])
