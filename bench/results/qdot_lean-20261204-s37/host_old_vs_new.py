"""2d8a780's QDOT vs this checkout's, compiled for the host (tests/qdot_host.py): every chunk code's
float outputs bit for bit, on random stored bytes and activations (a third of them only -128,
-127 and 127). Run from the repository root: python bench/results/qdot_lean-20261204-s37/host_old_vs_new.py"""
import sys, importlib.util, subprocess, tempfile
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
OLD = Path(tempfile.mkdtemp()) / "qdot_src.py"
OLD.write_text(subprocess.run(["git", "-C", str(ROOT), "show", "2d8a780:engine/kernels/qdot_src.py"], capture_output=True, text=True, check=True).stdout)
import numpy as np
import tests.qdot_host as H
from engine.quants_encode import random_blocks
spec = importlib.util.spec_from_file_location("qh", OLD); old = importlib.util.module_from_spec(spec)
old.__package__ = "engine.kernels"; spec.loader.exec_module(old)
VSUB = r"""
static inline unsigned int __vsubss4(unsigned int a, unsigned int b) {
    unsigned int r = 0;
    for (int i = 0; i < 4; i++) { int v = (int)(signed char)(a >> 8*i) - (int)(signed char)(b >> 8*i); v = v < -128 ? -128 : v > 127 ? 127 : v; r |= ((unsigned int)v & 0xffu) << 8*i; }
    return r;
}
"""
libs = {}
for name, q in (("old", old.QDOT), ("new", H.qdot_src.QDOT)):
    d = Path(tempfile.mkdtemp())
    H.qdot_src.QDOT, keep = q, H.qdot_src.QDOT
    H.SHIM, keep_s = H.SHIM + VSUB, H.SHIM
    libs[name] = H.HostDots(d, "g++")
    H.qdot_src.QDOT, H.SHIM = keep, keep_s
rng = np.random.default_rng(0)
n = 0
for code in H.CODES:
    t = H.TYPE_OF[code]
    rows = random_blocks(rng, t, 400, 2048, 0.05)
    for r in range(rows.shape[0]):
        xq, xd, xs16 = H.activations(rng, 2048, H.GROUP[t])
        if r % 3 == 0: xq[:] = rng.choice(np.array([-128, -127, 127], dtype=np.int8), size=xq.size); xs16 = xq.astype(np.int32).reshape(-1, 16).sum(1).astype(np.int32)
        a = libs["old"].dots(code, rows[r], xq, xd, xs16); b = libs["new"].dots(code, rows[r], xq, xd, xs16)
        assert (a.view(np.uint32) == b.view(np.uint32)).all(), (code, r)
        n += a.size
    print(code, "identical")
print(n, "chunks")
