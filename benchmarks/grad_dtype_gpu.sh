#!/usr/bin/env bash
# One GPU, for benchmarks/fidelity.py: 1b with --bf16-copies at micro-batch 4, with the
# gradients accumulated in the compute dtype (`1b_single`) and in float32 (`1b-gradfp32_single`:
# --grad-dtype float32), ROUNDS rounds (default 2) in turn, each in another order; then a
# Llama-3-shaped 3B (d_model 3072, 28 layers, 24 heads, 8 key/value heads, d_ff 8192,
# vocabulary 128256, sequence 8192, micro-batch 1, --bf16-copies) without and with full
# recomputation (`3b_single`, `3b-acfull_single`). Logs and JSON in $LOGS, packed into
# $OUT/gpu_logs.tgz.
set -uo pipefail
rounds=${1:-2}
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
c=(--dtype bfloat16 --steps 10 --bf16-copies)
suffix() { [ "$1" = 1 ] && echo "" || echo "_$1"; }
for r in $(seq 1 "$rounds"); do
  s=$(suffix "$r")
  one() { run "1b_single$s" 1 200 train --model 1b "${c[@]}" --micro-batch-size 4 --json "$LOGS/1b_single$s.json"; }
  two() { run "1b-gradfp32_single$s" 1 200 train --model 1b "${c[@]}" --micro-batch-size 4 --grad-dtype float32 \
            --json "$LOGS/1b-gradfp32_single$s.json"; }
  if (( r % 2 )); then one; two; else two; one; fi
done
llama3b=n_layers=28,d_model=3072,n_heads=24,n_kv_heads=8,d_ff=8192,vocab_size=128256,seq_len=8192
run 3b_single 1 240 train --model 1b --model-config "$llama3b" "${c[@]}" --micro-batch-size 1 --json "$LOGS/3b_single.json"
run 3b-acfull_single 1 240 train --model 1b --model-config "$llama3b" "${c[@]}" --micro-batch-size 1 --ac full \
  --json "$LOGS/3b-acfull_single.json"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
