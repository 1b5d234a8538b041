#!/usr/bin/env bash
# The host's time per op on one GPU, in one call: benchmarks/host_floor_gpu.py (calibrate's tiny
# forward and backward at 1-24 blocks of 350m, 1b and 1b-moe's dense model: a cost per op and
# one per step), then each model's training step with the device alone recorded
# (benchmarks/gpu_profile.py --device-only: the kernels a step; the host's own time from the
# train JSON), twice in turn: 350m (micro-batch 8), 1b and the dense model (micro-batch 4), all
# bf16 with --bf16-copies; then the dense model under autocast (which kernels autocast adds).
# With the argument `profiler`, instead: whether a profiler slows the host, with the tiny step
# timed before and after a profiler session in one process (host_floor_gpu.py
# --profiler-effect), and 350m trained unprofiled (`350m_plain_N`) and with the device alone
# recorded (`350m_N`), twice in turn. Logs and JSON in $LOGS, packed into $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
if [ "${1:-}" = profiler ]; then
  timeout 200 python benchmarks/host_floor_gpu.py --models 350m --depths 1,12 --profiler-effect \
    --json "$LOGS/host_floor.json" > "$LOGS/host_floor.log" 2>&1
  grep "µs\|blocks:" "$LOGS/host_floor.log"
  for r in 1 2; do
    run "350m_plain_$r" 1 120 train --model 350m --bf16-copies --dtype bfloat16 --steps 12 --micro-batch-size 8 \
      --json "$LOGS/350m_plain_$r.json"
    device_profile "350m_$r" --model 350m --bf16-copies --micro-batch-size 8
  done
  exit 0
fi
timeout 240 python benchmarks/host_floor_gpu.py --json "$LOGS/host_floor.json" 2>&1 | tee "$LOGS/host_floor.log" | tail -4
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
for r in 1 2; do
  device_profile 350m_$r --model 350m --bf16-copies --micro-batch-size 8
  device_profile 1b_$r --model 1b --bf16-copies
  device_profile dense_$r --model 1b-moe --model-config n_experts=0,d_ff=5472 --bf16-copies
done
device_profile dense_autocast --model 1b-moe --model-config n_experts=0,d_ff=5472
