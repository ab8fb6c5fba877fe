"""Prefill on the 4B shape: mmq vs aligned tiles + cuBLAS, by tokens; full passes; forced first-chunk graph."""
import time, gc, sys
import numpy as np, cupy as cp
from engine import load_model, EngineOptions
from engine.backends import cupy_backend as cb
m = load_model(sys.argv[1], backend="cupy", n_ctx=4096, kv_dtype="f16", options=EngineOptions(cupy_prefill_graph=True))
tf = m.transformer; ops = tf.ops
print("graphs", type(ops.prefill_graphs).__name__, "mmq_tokens", ops.mmq_tokens)
rng = np.random.default_rng(0)
prompt = rng.integers(100, 20000, 512).tolist()
BIG = 10**9
def run(n, mt, graph=False):
    ops.mmq_tokens = mt
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    out = tf.forward(prompt[:n], 0, last_n=1, graph=graph)
    l = cp.asnumpy(out)
    return time.perf_counter() - t0, l
modes = [("mmq", BIG, False), ("tiles", 128, False), ("tiles+graph", 128, True), ("mmq+graph", BIG, True)]
for n in (512, 256, 128+64):
    for md in modes: run(n, md[1], md[2]); run(n, md[1], md[2])
    times = {md[0]: [] for md in modes}; lg = {}
    gc.disable()
    for r in range(5):
        for md in modes:
            s, l = run(n, md[1], md[2]); times[md[0]].append(s); lg[md[0]] = l.reshape(-1).astype(np.float64)
    gc.enable()
    base = np.median(times["mmq"])
    print(f"n={n}: " + ", ".join(f"{k} {np.median(v)*1e3:.2f} ms ({n/np.median(v):,.0f} tok/s, {base/np.median(v):.2f}x)" for k, v in times.items()))
    a = lg["mmq"]
    for k, b in lg.items():
        print(f"    {k}: logits rel diff vs mmq {np.abs(a-b).max()/np.abs(a).max():.2e}, argmax {int(b.argmax())}")
ops.mmq_tokens = 128
e0, e1 = cp.cuda.Event(), cp.cuda.Event()
cp.cuda.Device().synchronize(); t0 = time.perf_counter(); e0.record()
out = tf.forward(prompt, 0, last_n=1, graph=False); e1.record(); th = time.perf_counter() - t0; e1.synchronize()
print(f"one pass tiles: GPU span {cp.cuda.get_elapsed_time(e0, e1):.2f} ms, host issue {th*1e3:.2f} ms")
def timeit(f, n=10):
    for _ in range(2): f()
    a, b = cp.cuda.Event(), cp.cuda.Event(); a.record()
    for _ in range(n): f()
    b.record(); b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / n * 1e3
L = tf.layers[0]
for scratch in (16, 8, 32):
    cb.SCRATCH_ELEMS = scratch * 1024 * 1024; ops._scratch = None
    line = []
    for t in (64, 96, 128, 192, 256, 384, 512):
        tot = {"mmq": 0.0, "tiles": 0.0}
        for name, w in (("qkv", L.wqkv), ("o", L.wo), ("gate_up", L.w_gate_up), ("down", L.w_down)):
            x = cp.asarray(rng.standard_normal((t, w.shape[1]), dtype=np.float32))
            ops.mmq_tokens = BIG; tot["mmq"] += timeit(lambda: ops.matmul(w, x, None, aq="q8_k"))
            ops.mmq_tokens = 0; tot["tiles"] += timeit(lambda: ops.matmul(w, x, None, aq="q8_k"))
        line.append(f"T={t}: mmq {tot['mmq']:.0f} / tiles {tot['tiles']:.0f} us ({tot['mmq']/tot['tiles']:.2f}x)")
    print(f"scratch {scratch}M values, layer 0 GEMMs: " + "; ".join(line))
cb.SCRATCH_ELEMS = 16 * 1024 * 1024; ops._scratch = None
