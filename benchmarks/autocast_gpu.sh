#!/usr/bin/env bash
# Where bf16 autocast's step goes on one GPU, beside --bf16-copies, and the host's kernel floor
# on the lent host, in one call:
# 1. the device alone recorded (benchmarks/gpu_profile.py --device-only, which kernels take its
#    time) for 1b-moe's dense model of the same active FLOPs (n_experts=0, d_ff=5472) and for
#    1b-moe with --cuda-graphs, each under autocast and with --bf16-copies, in turn;
# 2. `playground calibrate` on this GPU (its kernel_floor: the host's time per eager op);
# 3. 350m (micro-batch 8, --bf16-copies) three times: the host's own time of a step
#    (the step less `host_blocked_s`) beside the plan's issuing on that floor.
# Logs and JSON in $LOGS, packed into $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
dense=(--model 1b-moe --model-config n_experts=0,d_ff=5472)
device_profile dense_autocast "${dense[@]}" --autocast
device_profile dense_copies "${dense[@]}" --bf16-copies
device_profile graphs_autocast --model 1b-moe --cuda-graphs --autocast
device_profile graphs_copies --model 1b-moe --cuda-graphs --bf16-copies
timeout 200 torchrun --nproc_per_node 1 -m playground calibrate --backend torch --out "$LOGS/h200_here.json" \
  > "$LOGS/calibrate.log" 2>&1
echo "== calibrate (exit $?): $(grep -E 'kernel_floor|matmul_fraction|hbm_fraction' "$LOGS/calibrate.log" | tr '\n' ' ')"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
for r in 1 2 3; do
  run "350m_$r" 1 120 train --dtype bfloat16 --steps 10 --model 350m --bf16-copies --micro-batch-size 8 \
    --json "$LOGS/350m_$r.json"
done
