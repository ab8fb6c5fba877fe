"""The CUDA backend's own tests (`tests/test_cupy_*.py`, marked gpu) run on the host: child
pytest processes whose `cupy` is the stand-in in `tests/host_cupy` (kernels compiled for the host
by `tests/cuda_host.py`), so the whole device path - weight upload, the decoder's launch list and
its graph, the prefill GEMMs and attention, the device sampler, the decode loop chained on the
device - runs in CI without a GPU, on small synthetic models. A selection keeps it to a few
minutes (a step of the 3-layer test model takes ~0.15 s there); each child must pass exactly the
tests asked for, none skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cuda_host import cxx_or_skip

ROOT = Path(__file__).resolve().parent.parent

RUNS: dict[str, tuple[str, str, dict[str, str], int]] = {
    # name: (test file, -k selection, environment, tests that must pass)
    # the decoder's logits against the generic pass: float GEMVs (Q4_1), Q4_K + Q6_K pieces
    # (integer GEMVs, two-type launches), gemma3's window and post-norms, an int8 cache
    "decoder-logits": (
        "test_cupy_decoder.py",
        "test_decoder_logits_match_generic and exact and (llama-Q4_1-extra0-f16 or qwen3-Q4_K-extra9 or "
        "gemma3-Q5_K-extra10 or qwen3-Q4_K-extra13)",
        {},
        4,
    ),
    # the eager fallback, the GEMV knobs against the default, two-type matrices in one launch
    "decoder-wiring": (
        "test_cupy_decoder.py",
        "eager_fallback or gemv_variants or two_type_matrix",
        {},
        9,
    ),
    "chain": ("test_cupy_chain.py", "sampled-all", {}, 1),
    # the H200's path (clusters, compute capability 9.0): past one cluster's positions the plain
    # attention kernel (plan_long), chosen by position also for chained steps
    "decoder-long": ("test_cupy_decoder.py", "long_contexts", {"HOST_CUPY_CC": "90", "HOST_CUPY_SMS": "8"}, 1),
    "sampler": (
        "test_cupy_sample.py",
        "matches_host_sampler and not 151936 and not 49152 or eager_launches or sampled_decode_allocates",
        {},
        4,
    ),
    # the generic path's kernels against their NumPy twins: GEMV, prefill matmul and dequantisation
    # of every type, activation rounding, norms, RoPE, attention, GLU, argmax, the int8 KV store
    "backend-ops": ("test_cupy_backend.py", "not model_logits and not smollm2", {}, 63),
    "sample-mask": ("test_cupy_sample_mask.py", "mask_and_bias and 1000", {}, 1),
    "mmq": ("test_cupy_mmq.py", "matmul or int8", {}, 4),
    # prefill: blocked attention on f32 / f16 / int8 caches, fp16 tiles' argmax, the tile rule
    # (its graphs stay GPU-only: the stand-in cannot record array arithmetic in a capture)
    "prefill": (
        "test_cupy_prefill.py",
        "blocked_prefill_attention or attention_precision or auto_tiles or fp16_tiles and (qwen3-Q4_K or gemma3-Q5_K)",
        {},
        16,
    ),
}


def _child(name: str, cache: Path) -> tuple[str, int, dict[str, int], str]:
    """Run one selection; (name, exit status, outcome counts, output)."""
    module, select, extra, _ = RUNS[name]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "host_cupy"), str(ROOT)]),
        "HOST_CUPY_CACHE": str(cache),
        **extra,
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / module), "-k", select]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", out)}
    return name, r.returncode, counts, out


@pytest.mark.timeout(1500)
def test_selected_gpu_tests_pass_on_the_host(tmp_path: Path) -> None:
    """Every selected GPU test passes with the host stand-in for CuPy, none skipped or missing."""
    cxx_or_skip("the CUDA backend")
    with ThreadPoolExecutor(max_workers=2) as pool:  # CI's two cores; the modules built once, shared
        results = list(pool.map(lambda n: _child(n, tmp_path), sorted(RUNS, key=lambda n: -RUNS[n][3])))
    bad = [
        f"{name}: exit {rc}, {counts} (want {RUNS[name][3]} passed)\n{out[-6000:]}"
        for name, rc, counts, out in results
        if rc != 0 or counts.get("skipped", 0) or counts.get("passed", 0) != RUNS[name][3]
    ]
    assert not bad, "\n\n".join(bad)
