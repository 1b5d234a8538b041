#!/usr/bin/env bash
# One GPU: the host's time in compiled regions inside whole steps (benchmarks/
# region_host_in_step_gpu.py: 1b-moe without and under full recomputation, 1b-dsmoe), then
# `playground calibrate` on the same host. bf16 with compute copies, 10 steps, JSONs in $LOGS.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
case $(head -1 "$LOGS/gpus.txt") in *H100*) gpu=h100 ;; *) gpu=h200 ;; esac
c="--dtype bfloat16 --steps 10 --bf16-copies --micro-batch-size 4 --backend torch --no-progress"
for r in "1b-moe_single --model 1b-moe" "1b-moe-acfull-b4_single --model 1b-moe --ac full" "1b-dsmoe_single --model 1b-dsmoe"; do
  set -- $r; name=$1; shift
  timeout 120 torchrun --nproc_per_node 1 benchmarks/region_host_in_step_gpu.py --json "$LOGS/$name.regions.json" --steps 10 \
    -- train $c "$@" --json "$LOGS/$name.json" 2>&1 | grep -v "^W1" > "$LOGS/$name.log"
  echo "== $name: $(grep -h 'throughput\|host in compiled' "$LOGS/$name.log" | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
done
timeout 130 torchrun --nproc_per_node 1 -m playground calibrate --backend torch --model 1b --micro-batch-size 4 \
    --base $gpu-datasheet --name $gpu-one-gpu --out "$LOGS/$gpu-one-gpu.json" 2>&1 | grep -v "^W1" > "$LOGS/calibrate.log"
echo "== calibrate (exit ${PIPESTATUS[0]})"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
