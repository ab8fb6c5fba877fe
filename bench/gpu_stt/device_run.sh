#!/bin/bash
# The GPU voice-path bench on the device machine (see docs/benchmarks.md, "Voice path on the GPU").
#   bash bench/gpu_stt/device_run.sh smoke|full|decode|matrix   (the project's deps carried as wheels in .whl-gpu-stt)
# Writes logs and results under $OUT (default /tmp/out).
MODE=${1:-smoke}
OUT=${OUT:-/tmp/out}
RES=/tmp/res
mkdir -p "$OUT" $RES
trap 'cp /tmp/w-*/daemon.log /tmp/w-*/gpu_stt.log $RES/ 2>/dev/null; tar czf "$OUT/results.tgz" -C $RES .' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-gpu-stt/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import genie_supervisor.app, engine, wyoming, fastapi, cupy, transformers; print('imports ok')" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader

mps_start() {  # an Orin-like share: 6 % of 132 SMs ~ 8 SMs for every client started after this
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=6 nvidia-cuda-mps-control -d && export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=6
}
mps_stop() { echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; sleep 1; }
sm_probe() {  # SMs the process sees and a bf16 4096^3 matmul's time (the share is real if it is ~16x slower)
  python3 - <<'PY'
import torch, time
p = torch.cuda.get_device_properties(0); a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(3): a @ a
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(10): a @ a
torch.cuda.synchronize(); print(f"sm_probe: {p.multi_processor_count} SMs visible, 4096^3 bf16 matmul {(time.perf_counter() - t) * 100:.2f} ms")
PY
}

if [ "$MODE" = smoke ]; then
  sm_probe
  timeout 200 python3 -m pytest -c /dev/null --rootdir . -p no:cacheprovider -q tests/test_gpu_stt_smoke.py 2>&1 | tail -5
  timeout 200 python3 -m bench.voice_path --gpu --quick --preset smollm2-135m-q4_1 --stt-size small --period 3 \
    --load-tokens 96 --out $RES/quick --workdir /tmp/w-quick 2>&1 | tail -25
  tail -4 /tmp/w-quick/gpu_stt.log; cat $RES/quick/summary.json
  mps_start && sm_probe; mps_stop
  exit 0
fi

if [ "$MODE" = decode ]; then  # decode-heavy load: short prompts, long answers (the LLM decodes most of the time)
  timeout ${T1:-150} python3 -m bench.voice_path --gpu --preset qwen3-4b-q4_k_m --stt-size small --turns 6 --period 3 \
    --load-clients 2 --load-tokens 400 --load-prompt-chars 0 --warmup 1 --rounds 1 --label h200-decode-heavy \
    --out $RES/decode --workdir /tmp/w-decode 2>&1 | tail -12
  cat $RES/decode/summary.json
  exit 0
fi

if [ "$MODE" = matrix ]; then  # the issue-16 matrix, one round each, the idle run asking the LLM too (--idle-llm):
  # decode-heavy on the whole H200 and on the 8-SM share, prefill-heavy (>= 1,500-token prompts) on the whole H200
  M="--gpu --preset qwen3-4b-q4_k_m --stt-size small --turns ${TURNS:-6} --period 3 --load-clients 2 --warmup 1 --rounds 1 --idle-llm"
  mkdir -p /tmp/w-m && python3 -c "from pathlib import Path; from bench.voice_path.gpu import synth_model; synth_model(Path('/tmp/w-m'), 'qwen3-4b-q4_k_m')"
  timeout ${T1:-170} python3 -m bench.voice_path $M --load-tokens 400 --load-prompt-chars 0 --label h200-decode-heavy \
    --out $RES/h200-decode-heavy --workdir /tmp/w-m 2>&1 | tail -4
  timeout ${T2:-170} python3 -m bench.voice_path $M --load-tokens 160 --label h200-prefill-heavy \
    --out $RES/h200-prefill-heavy --workdir /tmp/w-m 2>&1 | tail -4
  if [ "${MPS:-1}" = 1 ] && mps_start; then
    sm_probe
    timeout ${T3:-220} python3 -m bench.voice_path $M --load-tokens 400 --load-prompt-chars 0 --label mps-8sm-decode-heavy \
      --out $RES/mps-8sm-decode-heavy --workdir /tmp/w-m 2>&1 | tail -4
    mps_stop
  fi
  for f in $RES/*/summary.json; do echo "== $f"; cat "$f"; done
  exit 0
fi

# full: H200 whole, then the 8-SM share (MPS), Qwen3-4B shape
ARGS="--gpu --preset qwen3-4b-q4_k_m --stt-size small --turns ${TURNS:-6} --period ${PERIOD:-3} --load-clients 2 --load-tokens 160 --warmup 2"
mkdir -p /tmp/w-full
python3 -c "from pathlib import Path; from bench.voice_path.gpu import synth_model; print(synth_model(Path('/tmp/w-full'), 'qwen3-4b-q4_k_m'))"
timeout ${T1:-260} python3 -m bench.voice_path $ARGS --rounds ${ROUNDS:-2} --label h200-132sm --out $RES/h200 --workdir /tmp/w-full 2>&1 | grep -v "^\s*$" | tail -30
cp /tmp/w-full/daemon.log $RES/daemon-h200.log; cp /tmp/w-full/gpu_stt.log $RES/gpu_stt-h200.log
if mps_start; then
  sm_probe
  timeout ${T2:-200} python3 -m bench.voice_path $ARGS --rounds ${ROUNDS2:-1} --label mps-8sm --out $RES/mps --workdir /tmp/w-full 2>&1 | tail -12
  cp /tmp/w-full/gpu_stt.log $RES/gpu_stt-mps.log
  mps_stop
fi
cat $RES/*/summary.json
