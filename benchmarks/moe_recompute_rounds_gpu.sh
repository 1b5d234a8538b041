#!/usr/bin/env bash
# One GPU: `playground calibrate` (one block of 1b at micro-batch 4, on the GPU's datasheet
# profile: the kernels, the host's floor per op and what selective checkpointing adds to it),
# then 1b-moe (bf16, micro-batch 4, --bf16-copies, 10 steps) under --ac none, full and
# selective, in ROUNDS alternated rounds (default 2), for plans on the calibrated profile
# against the median of each mode's runs (benchmarks/fidelity.py --measured <run> --hardware
# <the profile>). Logs and train JSONs in $LOGS, packed into $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh
rounds=${1:-2}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
case $(head -1 "$LOGS/gpus.txt") in *H100*) gpu=h100 ;; *) gpu=h200 ;; esac
timeout 150 torchrun --nproc_per_node 1 -m playground calibrate --backend torch --model 1b --micro-batch-size 4 \
  --base $gpu-datasheet --name $gpu-one-gpu --out "$LOGS/$gpu-one-gpu.json" 2>&1 | grep -v "^W1" > "$LOGS/calibrate.log"
echo "== calibrate (exit ${PIPESTATUS[0]}): $(grep -E 'kernel_floor|selective_floor' "$LOGS/calibrate.log" | tr '\n' ' ')"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
c="--dtype bfloat16 --steps 10 --bf16-copies --model 1b-moe --micro-batch-size 4"
orders=("none full selective" "selective full none" "full selective none")
for r in $(seq 1 "$rounds"); do
  for ac in ${orders[$(( (r - 1) % 3 ))]}; do
    case $ac in none) name=1b-moe_single ;; full) name=1b-moe-acfull-b4_single ;; *) name=1b-moe-acsel-b4_single ;; esac
    run "${name}_$r" 1 80 train $c --ac $ac --json "$LOGS/${name}_$r.json"
  done
done
