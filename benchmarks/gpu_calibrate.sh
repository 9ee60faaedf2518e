#!/usr/bin/env bash
# autopar's own program on this machine's GPU(s), measured against its cost model:
#   1. `autopar profile` of the GPUs (one GPU: --links dgx-h100 lends the links it cannot time);
#   2. `autopar calibrate` of a ~1B GPT plan priced on the shipped dgx-h100 profile: predicted vs
#      measured step time, per phase, and peak memory (the allocator's max_memory_allocated);
#   3. the same with 4 micro-batches of 4 (gradient accumulation), and the planner's pick on the
#      profile step 1 wrote.
# Usage: benchmarks/gpu_calibrate.sh [OUTDIR]   (GPUS=n for more than one GPU; PYTHON=...)
# Every step runs under `timeout`, its output in OUTDIR/<step>.log; a failed step does not stop
# the ones after it. Figures of 2026-11-27 (one H100 80GB HBM3): README, section "On a GPU".
set -u
out=${1:-gpu-calibrate}
mkdir -p "$out"
py=${PYTHON:-python3}
gpus=${GPUS:-1}
model="gpt:layers=16,hidden=2048,heads=16,vocab=32000,seq=2048,tied=0"
step() {  # step NAME SECONDS COMMAND...: run it, keep its output, say how it ended
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s"
  tail -n 8 "$out/$name.log" | cut -c1-400
}
links=()
[ "$gpus" = 1 ] && links=(--links dgx-h100)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
step profile 180 "$py" -m autopar.cli profile --ranks "$gpus" "${links[@]}" --out "$out/local-gpu.json"
step plan-shipped 60 "$py" -m autopar.cli plan --model "$model" --cluster dgx-h100 --gpus "$gpus" --global-batch 16 \
  --out "$out/plan-shipped.json"
step calibrate-shipped 120 "$py" -m autopar.cli calibrate "$out/plan-shipped.json" --steps 10 \
  --out "$out/dgx-h100.calibrated.json" --json
step plan-accum 60 "$py" -m autopar.cli plan --model "$model" --cluster dgx-h100 --gpus "$gpus" --global-batch 16 --mbs 4 \
  --out "$out/plan-accum.json"
step calibrate-accum 120 "$py" -m autopar.cli calibrate "$out/plan-accum.json" --steps 10 \
  --out "$out/dgx-h100.accum.calibrated.json" --json
if [ -f "$out/local-gpu.json" ]; then
  step plan-local 60 "$py" -m autopar.cli plan --model "$model" --cluster "$out/local-gpu.json" --gpus "$gpus" --global-batch 16 \
    --out "$out/plan-local.json"
  step calibrate-local 120 "$py" -m autopar.cli calibrate "$out/plan-local.json" --steps 10 \
    --out "$out/local-gpu.calibrated.json" --json
fi
