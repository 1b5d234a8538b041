#!/usr/bin/env bash
# One H200 (the device tool's needs_h200): `playground calibrate` on 1b at micro-batch 4, the
# model simulator/profiles/h200.json was fitted on (its one-GPU fields refitted: the narrow
# program's kernel_floor and region_op_floor, the optimizer's rate, the HBM rate by class on the
# profiled block, attention by its kernels' time; its NVLink α, β and collective_floor stay the
# 2-GPU calibration's), then 350m and 1b-moe; and the one-GPU rows of benchmarks/fidelity.py
# the refitted profile is judged on, on the same host: 350m, 1b-moe and 350m under ZeRO-3 at
# dp 1 twice, alternated (host-bound: judged on the median of the runs), and 1b once.
# bf16 with compute copies, 10 steps each, --json in $LOGS.
set -uo pipefail
source benchmarks/gpu_common.sh
one_gpu_host
c="--dtype bfloat16 --steps 10 --bf16-copies"
calibrate $gpu 1b 4
for round in "" _2; do
  run 350m_single$round 1 60 train $c --model 350m --micro-batch-size 8 --json "$LOGS/350m_single$round.json"
  run 1b-moe_1gpu$round 1 80 train $c --model 1b-moe --micro-batch-size 4 --json "$LOGS/1b-moe_1gpu$round.json"
  run 350m_zero3-w1$round 1 90 train --dtype bfloat16 --steps 10 --model 350m --zero 3 --micro-batch-size 8 \
    --json "$LOGS/350m_zero3-w1$round.json"
  if [ -z "$round" ]; then
    run 1b_single 1 70 train $c --model 1b --micro-batch-size 4 --json "$LOGS/1b_single.json"
    calibrate $gpu 350m 8
  fi
done
calibrate $gpu 1b-moe 4
