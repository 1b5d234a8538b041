#!/usr/bin/env bash
# The gradients' NaN check on one GPU, in one call. First the skip on the device tested there
# (tests/test_master_adamw.py: the compiled one pass and torch's fused AdamW given `found_inf`)
# and a NaN injected into runs of small (--bf16-copies) and 1b-moe (--bf16-copies --cuda-graphs),
# skipped and stopped. Then, in turn, this tree (the check read a step late, each update skipped
# on the device: playground/faults.py, LaggedCheck), an earlier tree (DIR: `git archive COMMIT |
# tar -x -C DIR`; the check read on the host before each optimizer step) and this tree with
# --on-nan off, each with the device alone recorded (device_profile, benchmarks/gpu_common.sh):
# 1b-moe with --bf16-copies --cuda-graphs ROUNDS times (default 2), then once its dense model
# of the same active FLOPs with --bf16-copies and the autocast command (1b-moe, no flags), this
# tree and the earlier one.
# Logs and JSON in $LOGS, packed into $OUT/gpu_logs.tgz.
set -uo pipefail
old=$(cd "$1" && pwd); rounds=${2:-2}
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_master_adamw.py > "$LOGS/tests.log" 2>&1
echo "== tests: $(tail -1 "$LOGS/tests.log")"
nan() {  # name, on-nan, playground train args...
  local name=$1 mode=$2; shift 2
  run "$name" 1 300 train "$@" --dtype bfloat16 --bf16-copies --on-nan "$mode" --json "$LOGS/$name.json"
  echo "   $(grep -h 'skipped\|NonFinite\|stopped' "$LOGS/$name.log" | head -2 | cut -c1-240 | tr '\n' ' ')"
}
nan nan_skip_small skip --model small --steps 6 --inject nan@3:0
nan nan_stop_small stop --model small --steps 6 --inject nan@3:0
nan nan_skip_moe_graphs skip --model 1b-moe --cuda-graphs --micro-batch-size 4 --steps 8 --inject nan@5:0
trio() {  # name, playground train args...: this tree, the earlier one and this one with --on-nan off, in an order
  local name=$1 order=$2; shift 2
  for side in $order; do
    case $side in
      late) device_profile "${name}_late" "$@" ;;
      off) device_profile "${name}_off" "$@" --on-nan off ;;
      old) (cd "$old" && export PYTHONPATH="$old" && device_profile "${name}_old" "$@") ;;
    esac
  done
}
orders=("old late off" "off late old" "late old off")
for r in $(seq 1 "$rounds"); do
  trio "graphs_copies_$r" "${orders[$(( (r - 1) % 3 ))]}" --model 1b-moe --bf16-copies --cuda-graphs
done
trio dense_copies_1 "late old" --model 1b-moe --model-config n_experts=0,d_ff=5472 --bf16-copies
trio moe_autocast_1 "old late" --model 1b-moe
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
