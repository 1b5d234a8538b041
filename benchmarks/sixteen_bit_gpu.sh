#!/usr/bin/env bash
# 16-bit verdicts and recipes on one CUDA GPU (run through the device tool): the check in bf16
# with experts (their gradients judged, the near-ties bf16 flips replayed; on a GPU of compute
# capability 9.0 the MoE layer runs as one compiled region, `whole_layer`, which hands the
# check its decisions), with the balancing bias kept float32 beside bf16 compute copies and
# under autocast; the check in fp16 with experts (the auxiliary losses loss-scaled) and dense;
# `check --compile` in float64; and 1b-dsmoe trained in bf16. Logs go to $OUT/gpu_logs.tgz;
# one verdict line each is printed.
set -u
source benchmarks/gpu_common.sh
CHECK=(--steps 3 --micro-batch-size 2)
run check_moe_bf16 1 240 check --model tiny-moe --dtype bfloat16 "${CHECK[@]}"
run check_dsmoe_bf16 1 240 check --model tiny-dsmoe --dtype bfloat16 "${CHECK[@]}"
run check_dsmoe_bf16_autocast 1 240 check --model tiny-dsmoe --dtype bfloat16 --autocast "${CHECK[@]}"
run check_moe_fp16 1 240 check --model tiny-moe --dtype float16 "${CHECK[@]}"
run check_dsmoe_fp16 1 240 check --model tiny-dsmoe --dtype float16 "${CHECK[@]}"
run check_tiny_fp16 1 240 check --model tiny --dtype float16 "${CHECK[@]}"
run check_compile_f64 1 240 check --model tiny --dtype float64 --compile "${CHECK[@]}"
run train_1b_dsmoe_bf16 1 300 train --model 1b-dsmoe --dtype bfloat16 --micro-batch-size 4 --steps 12 \
  --json "$LOGS/train_1b_dsmoe_bf16.json"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
