#!/usr/bin/env bash
# bf16's default recipe (compute copies of fp32 masters) on one GPU, in one call: three
# alternated rounds of the MoE issue's command as it is typed (`train --model 1b-moe
# --micro-batch-size 4 --dtype bfloat16`, now compute copies), the same with --autocast (what
# it ran before), with --cuda-graphs, and the dense model of 1b-moe's active FLOPs (n_experts=0,
# d_ff=5472) as typed; then the typed command once with the device alone recorded over steps
# 6-10 (benchmarks/gpu_profile.py --device-only: busy and idle time, the host's own time beside
# it in the train JSON). Logs and JSON in $LOGS, packed into $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
one() {  # name, playground train args...
  local name=$1; shift
  run "$name" 1 150 train --dtype bfloat16 --micro-batch-size 4 --steps 12 "$@" --json "$LOGS/$name.json"
}
orders=("typed autocast graphs dense" "dense graphs autocast typed" "autocast typed dense graphs")
for r in 1 2 3; do
  for side in ${orders[$((r - 1))]}; do
    case $side in
      typed) one "typed_$r" --model 1b-moe ;;
      autocast) one "autocast_$r" --model 1b-moe --autocast ;;
      graphs) one "graphs_$r" --model 1b-moe --cuda-graphs ;;
      dense) one "dense_$r" --model 1b-moe --model-config n_experts=0,d_ff=5472 ;;
    esac
  done
done
device_profile typed_profiled --model 1b-moe
