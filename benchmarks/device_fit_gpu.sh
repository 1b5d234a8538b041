#!/usr/bin/env bash
# One GPU (an H100 or an H200, whichever is lent): `playground calibrate` with attention timed
# over a table of head dimensions and sequences (separate query, key and value) and the
# optimizer's one-pass step timed over a 64 Mi unit (playground/calibrate.py: attention_table,
# optimizer_hbm_fraction; matmuls and attention back to back), on 1b-moe, 350m and 1b; the
# three models' steps on the same host (350m and 1b-moe twice, alternated: their steps are
# host-bound and move between runs); and 1b-moe's device alone recorded (CUPTI: which kernels
# take its time, against a plan's by op). Plans of each on each calibration:
# benchmarks/fidelity.py --measured <this run> --hardware <profile>.
# bf16 with compute copies, 10 steps each, --json in $LOGS.
set -uo pipefail
source benchmarks/gpu_common.sh
one_gpu_host
c="--dtype bfloat16 --steps 10 --bf16-copies"
calibrate $gpu 1b-moe 4
for round in "" _2; do
  run 350m_single$round 1 60 train $c --model 350m --micro-batch-size 8 --json "$LOGS/350m_single$round.json"
  run 1b-moe_1gpu$round 1 80 train $c --model 1b-moe --micro-batch-size 4 --json "$LOGS/1b-moe_1gpu$round.json"
  if [ -z "$round" ]; then
    run 1b_single 1 70 train $c --model 1b --micro-batch-size 4 --json "$LOGS/1b_single.json"
    calibrate $gpu 350m 8 && calibrate $gpu 1b 4
  fi
done
device_profile 1b-moe_device --model 1b-moe --bf16-copies
