"""Prefill 512 on the 4B shape: where the time goes; mmq vs tile path vs whole-matrix cuBLAS (upper bound)."""
import time, gc, sys
import numpy as np, cupy as cp
from engine import load_model
m = load_model(sys.argv[1], backend="cupy", n_ctx=4096, kv_dtype="f16")
tf = m.transformer; ops = tf.ops
rng = np.random.default_rng(0)
prompt = rng.integers(100, 20000, 512).tolist()
def run(flag):
    ops.mmq = flag
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    out = tf.forward(prompt, 0, last_n=1, graph=False)
    cp.asnumpy(out)
    return time.perf_counter() - t0
for flag in (True, False, True, False):
    run(flag)
times = {False: [], True: []}
gc.disable()
for r in range(5):
    for flag in (True, False):
        times[flag].append(run(flag))
gc.enable()
for flag in (True, False):
    med = float(np.median(times[flag]))
    print(f"prefill 512 {'mmq ' if flag else 'tile'}: median {med*1e3:.2f} ms = {512/med:,.0f} tok/s")
# GPU span of one pass (events) vs host
ops.mmq = True
e0, e1 = cp.cuda.Event(), cp.cuda.Event()
cp.cuda.Device().synchronize(); t0 = time.perf_counter(); e0.record()
out = tf.forward(prompt, 0, last_n=1, graph=False); e1.record(); th = time.perf_counter() - t0; e1.synchronize()
print(f"one pass mmq: GPU span {cp.cuda.get_elapsed_time(e0, e1):.2f} ms, host issue {th*1e3:.2f} ms")
def timeit(f, n=10):
    for _ in range(2): f()
    a, b = cp.cuda.Event(), cp.cuda.Event(); a.record()
    for _ in range(n): f()
    b.record(); b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / n * 1e3
L = tf.layers[0]
tot = {}
for name, w in (("qkv", L.wqkv), ("o", L.wo), ("gate_up", L.w_gate_up), ("down", L.w_down)):
    x = cp.asarray(rng.standard_normal((512, w.shape[1]), dtype=np.float32))
    rows, cols = w.shape
    res = {}
    ops.mmq = True; res["mmq"] = timeit(lambda: ops.matmul(w, x, None, aq="q8_k"))
    ops.mmq = False; res["tile"] = timeit(lambda: ops.matmul(w, x, None, aq="q8_k"))
    ops.mmq = True
    wt = cp.empty((rows, cols), dtype=cp.float16)
    def deq():
        b = 0
        for p in w.pieces():
            ops.dequant_f16(p, 0, p.shape[0], wt[b:b + p.shape[0]]); b += p.shape[0]
    res["dequant"] = timeit(deq)
    xs = x.astype(cp.float16); y = cp.empty((512, rows), dtype=cp.float32)
    res["gemmex32"] = timeit(lambda: ops._gemm(wt, xs, y, 0))
    res["matmul16"] = timeit(lambda: cp.matmul(xs, wt.T))
    res["actq"] = timeit(lambda: ops.act_quant(x, "q8_k", half=True))
    for k, v in res.items(): tot[k] = tot.get(k, 0) + v
    types = [p.type_name for p in w.pieces()]
    fl = 2 * 512 * rows * cols
    print(f"  {name:8s} {w.shape} {types}: " + ", ".join(f"{k} {v:.0f} us" for k, v in res.items()) + f"  | mmq {fl/res['mmq']/1e6:.0f} TFLOP/s, matmul16 {fl/res['matmul16']/1e6:.0f}")
    del wt
print("layer 0 totals: " + ", ".join(f"{k} {v:.0f} us" for k, v in tot.items()))
