#!/usr/bin/env bash
# One GPU: calibrate's narrow step (playground/calibrate.py: measure_program) of 350m, 1b and
# 1b-moe, three rounds alternated in one process, then each once under torch's profiler
# (benchmarks/narrow_floor_gpu.py): does the kernel floor follow the model or the host's moment?
# Then 350m's and 1b-moe's training steps on the same host.
set -uo pipefail
source benchmarks/gpu_common.sh
one_gpu_host; cat "$LOGS/gpus.txt"
timeout 500 torchrun --nproc_per_node 1 benchmarks/narrow_floor_gpu.py --json "$LOGS/narrow_floor.json" --rounds 3 2>&1 \
  | grep -v "^W1\|USDT" | tee "$LOGS/narrow_floor.log"
c="--dtype bfloat16 --steps 10 --bf16-copies"  # the real steps on the same host, for the floors to plan
run 350m_single 1 60 train $c --model 350m --micro-batch-size 8 --json "$LOGS/350m_single.json"
run 1b-moe_1gpu 1 80 train $c --model 1b-moe --micro-batch-size 4 --json "$LOGS/1b-moe_1gpu.json"
cp "$LOGS"/* "$OUT"/
