#!/usr/bin/env bash
# One GPU (an H100 or an H200, whichever is lent): `playground calibrate` with the host's time
# inside compiled regions timed apart in the model's narrow training step (playground/calibrate.py,
# `measure_program`, `program_floors`: kernel_floor over the eager ops, region_op_floor over the
# regions' graph ops), calibrated on 350m (dense), 1b-moe (the MoE layer's regions) and 1b
# (dense, device-bound), and the three models' full-width steps on the same host, twice in
# alternation (host-bound steps move between runs: medians of two). Plans of each on each
# calibration: benchmarks/fidelity.py --measured <this run> --hardware <profile>.
# bf16 with compute copies, 10 steps each, --json in $LOGS.
set -uo pipefail
source benchmarks/gpu_common.sh
one_gpu_host
c="--dtype bfloat16 --steps 10 --bf16-copies"
calibrate $gpu 1b-moe 4
for round in "" _2; do
  run 350m_single$round 1 60 train $c --model 350m --micro-batch-size 8 --json "$LOGS/350m_single$round.json"
  run 1b-moe_1gpu$round 1 80 train $c --model 1b-moe --micro-batch-size 4 --json "$LOGS/1b-moe_1gpu$round.json"
  run 1b_single$round 1 70 train $c --model 1b --micro-batch-size 4 --json "$LOGS/1b_single$round.json"
  [ -z "$round" ] && calibrate $gpu 350m 8 && calibrate $gpu 1b 4
done
