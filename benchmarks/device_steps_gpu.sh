#!/usr/bin/env bash
# Each step's time on the device against the host's, on one GPU, in one call: the test of the
# device's steps (tests/test_device_steps.py), then three alternated rounds of graphed 1b-moe
# with --bf16-copies with the gradients' NaN check (the default --on-nan stop: the host waits
# for the device once a step) and without it (--on-nan off: nothing makes the host wait), the
# issue's autocast command (1b-moe, bf16, micro-batch 4) and the dense model of 1b-moe's active
# FLOPs with --bf16-copies. Each train JSON holds both step lists (playground/device_steps.py).
# Logs and JSON in $LOGS, packed into $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_device_steps.py > "$LOGS/tests.log" 2>&1
echo "== tests: $(tail -1 "$LOGS/tests.log")"
one() {  # name, playground train args...
  local name=$1; shift
  run "$name" 1 150 train --dtype bfloat16 --micro-batch-size 4 --steps 12 "$@" --json "$LOGS/$name.json"
}
moe=(--model 1b-moe --cuda-graphs --bf16-copies)
orders=("check off autocast dense" "dense autocast off check" "off check dense autocast")
for r in 1 2 3; do
  for side in ${orders[$((r - 1))]}; do
    case $side in
      check) one "check_$r" "${moe[@]}" ;;
      off) one "off_$r" "${moe[@]}" --on-nan off ;;
      autocast) one "autocast_$r" --model 1b-moe ;;
      dense) one "dense_$r" --model 1b-moe --model-config n_experts=0,d_ff=5472 --bf16-copies ;;
    esac
  done
done
