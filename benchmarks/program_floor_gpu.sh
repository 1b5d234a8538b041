#!/usr/bin/env bash
# One GPU (an H100 or an H200, whichever is lent): the kernel floor `playground calibrate` now
# measures on the model's own training step at head dimension 8 (playground/calibrate.py,
# `measure_program`), checked on full-width steps of the same host that no calibration saw:
# calibrate on 350m, then 350m (host-bound on a slow host), 1b-moe (host-bound, compiled
# regions) and the dense 1b (device-bound), calibrate on 1b-moe, the three again in the same
# order (host-bound steps move between runs: medians of two). Plans of each on each
# calibration: benchmarks/fidelity.py --measured <this run> --hardware <profile>.
# bf16 with compute copies, 10 steps each, --json in $LOGS.
set -uo pipefail
source benchmarks/gpu_common.sh
one_gpu_host
c="--dtype bfloat16 --steps 10 --bf16-copies"
calibrate $gpu 350m 8
for round in "" _2; do
  run 350m_single$round 1 60 train $c --model 350m --micro-batch-size 8 --json "$LOGS/350m_single$round.json"
  run 1b-moe_1gpu$round 1 80 train $c --model 1b-moe --micro-batch-size 4 --json "$LOGS/1b-moe_1gpu$round.json"
  run 1b_single$round 1 70 train $c --model 1b --micro-batch-size 4 --json "$LOGS/1b_single$round.json"
  [ -z "$round" ] && calibrate $gpu 1b-moe 4
done
