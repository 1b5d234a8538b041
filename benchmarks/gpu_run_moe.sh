#!/usr/bin/env bash
# GPU run on a 2-GPU machine for the mixture of experts: the equivalence check of expert
# parallelism on NCCL (ep 2 in float64, with the capacity dropping tokens and dropless, and
# in bf16), then the 1b-moe preset (about 1B parameters, 8 experts, top-2) trained in bf16
# with ep 2 against ep 1 (the experts replicated), tokens/s and CUDA peak memory. Logs and
# JSON in $LOGS, packed after every run into $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh  # the environment, $OUT, $LOGS and run()
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$LOGS/gpus.txt"
S="--model small-moe --microbatches 2 --micro-batch-size 2"
run check_ep2_float64          2 150 check $S --ep 2 --dtype float64
run check_ep2_dropless_float64 2 150 check $S --ep 2 --dropless --dtype float64
run check_ep2_bf16             2 150 check $S --ep 2 --dtype bfloat16  # loss judged; routing-dependent rows reported
run check_ep2_zero3_float64    2 150 check $S --ep 2 --zero 3 --dtype float64
[ -n "${CHECKS_ONLY:-}" ] && exit 0
L="--model 1b-moe --dtype bfloat16 --micro-batch-size ${MBS:-4} --steps ${STEPS:-8}"
run train_1b_moe_ep2 2 280 train $L --ep 2 --json "$LOGS/train_1b_moe_ep2.json"
run train_1b_moe_ep1 2 280 train $L --json "$LOGS/train_1b_moe_ep1.json"
