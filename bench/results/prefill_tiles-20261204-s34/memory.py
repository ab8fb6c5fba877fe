"""GPU memory of a loaded 4B model after a 512-token prefill and a generate: cudaMemGetInfo delta and pool."""
import sys, anyio, numpy as np, cupy as cp
free0, total = cp.cuda.runtime.memGetInfo()
from engine import load_model, SamplingParams
m = load_model(sys.argv[1], backend="cupy", n_ctx=4096, kv_dtype="f16")
prompt = np.random.default_rng(0).integers(100, 20000, 512).tolist()
m.step_logits(prompt, 0)
async def gen():
    async for _ in m.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)):
        pass
try:
    anyio.run(gen)
except Exception as e:
    print("generate:", type(e).__name__, e)
cp.cuda.Device().synchronize()
free1, _ = cp.cuda.runtime.memGetInfo()
pool = cp.get_default_memory_pool()
print(f"{sys.argv[2]}: cudaMemGetInfo delta {(free0 - free1) / 2**20:.1f} MiB, default pool total {pool.total_bytes() / 2**20:.1f} MiB")
