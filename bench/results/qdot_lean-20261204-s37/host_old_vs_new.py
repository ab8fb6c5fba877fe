"""2d8a780's QDOT against this checkout's, both compiled for the host (tests/qdot_host.py): every
chunk code's float outputs bit for bit, on random stored bytes and activations (a third of the rows
with activations of only -128, -127 and 127).

    python bench/results/qdot_lean-20261204-s37/host_old_vs_new.py   # from the repository root
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import tests.qdot_host as host  # noqa: E402
from engine.quants_encode import random_blocks  # noqa: E402
from tests.cuda_host import compiler  # noqa: E402

REFERENCE = "2d8a780"


def reference_qdot() -> str:
    """The reference commit's `qdot_src.QDOT`."""
    show = ["git", "-C", str(ROOT), "show", f"{REFERENCE}:engine/kernels/qdot_src.py"]
    path = Path(tempfile.mkdtemp()) / "qdot_src.py"
    path.write_text(subprocess.run(show, capture_output=True, text=True, check=True).stdout)
    spec = importlib.util.spec_from_file_location("engine.kernels.qdot_ref", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.QDOT)


def build(qdot: str) -> host.HostDots:
    """The host library with `qdot` in place of this checkout's QDOT."""
    keep = host.qdot_src.QDOT
    host.qdot_src.QDOT = qdot
    try:
        return host.HostDots(Path(tempfile.mkdtemp()), compiler() or "c++")
    finally:
        host.qdot_src.QDOT = keep


def main() -> None:
    old, new = build(reference_qdot()), build(host.qdot_src.QDOT)
    rng = np.random.default_rng(0)
    n = 0
    for code in host.CODES:
        t = host.TYPE_OF[code]
        rows = random_blocks(rng, t, 400, 2048, 0.05)
        for r in range(rows.shape[0]):
            xq, xd, xs16 = host.activations(rng, 2048, host.GROUP[t])
            if r % 3 == 0:
                xq[:] = rng.choice(np.array([-128, -127, 127], dtype=np.int8), size=xq.size)
                xs16 = xq.astype(np.int32).reshape(-1, 16).sum(1).astype(np.int32)
            a, b = old.dots(code, rows[r], xq, xd, xs16), new.dots(code, rows[r], xq, xd, xs16)
            assert (a.view(np.uint32) == b.view(np.uint32)).all(), (code, r)
            n += a.size
        print(code, "identical")
    print(n, "chunks")


if __name__ == "__main__":
    main()
