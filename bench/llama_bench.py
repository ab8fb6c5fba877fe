"""llama.cpp's `llama-bench` on a GGUF file, for a same-run reference (`bench.engine_gpu --llama-bench PATH`).

Runs pp<prompt> (prompt processing alone) and tg<decode> at depth <prompt> (decode after a prompt of
that many tokens: what `Model.generate` does) with every layer on the GPU and flash attention, and
returns the tokens/s llama-bench reports (its mean over its repetitions). A binary without `-d`
(depth; older llama.cpp) is run for tg at depth 0, and the result says so.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

PUBLISHED = {  # tok/s; issue 19: llama.cpp 0c1e570, CUDA, flash attention, H200, the same generated files
    "smollm2": {"decode": 877.0, "prefill": 45000.0},
    "qwen3-4b": {"decode": 324.0, "prefill": 12200.0},
}
"""llama.cpp's figures published with issue 19 (tg128 at depth 512, pp512), the reference when no
binary is given."""


def _run(binary: str, args: list[str], timeout: float) -> list[dict[str, Any]]:
    out = subprocess.run([binary, *args, "-o", "json"], capture_output=True, text=True, timeout=timeout, check=True)
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


def measure(binary: str, model: str, prompt: int, decode: int, reps: int = 3, timeout: float = 300.0) -> dict[str, Any]:
    """llama-bench's pp`prompt` and tg`decode` @ depth `prompt` tokens/s on `model` (all layers on the GPU)."""
    common = ["-m", model, "-ngl", "99", "-fa", "1", "-r", str(reps)]
    pp = _run(binary, [*common, "-p", str(prompt), "-n", "0"], timeout)
    depth = prompt
    try:
        tg = _run(binary, [*common, "-p", "0", "-n", str(decode), "-d", str(prompt)], timeout)
    except subprocess.CalledProcessError:  # no -d: decode after an empty context
        depth = 0
        tg = _run(binary, [*common, "-p", "0", "-n", str(decode)], timeout)
    return {
        "prefill": float(pp[0]["avg_ts"]),
        "decode": float(tg[0]["avg_ts"]),
        "decode_depth": depth,
        "build": str(pp[0].get("build_commit", "")),
    }
