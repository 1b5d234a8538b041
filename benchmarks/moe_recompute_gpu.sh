#!/usr/bin/env bash
# One GPU: why 1b-moe (bf16, micro-batch 4, --bf16-copies) steps slower than its plan, and
# slower under --ac selective than under --ac full (run70). Per mode (none, full, selective):
# the device alone recorded over steps 6-10 (benchmarks/gpu_profile.py --device-only: the
# device's period, busy and idle time per step, its kernels); then --ac selective with
# Dynamo's recompilations and graph breaks logged; then full and selective under the torch
# profiler (host ops by CPU time, launches per step). Logs, profiles and train JSONs in $LOGS,
# packed into $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
for ac in none full selective; do
  device_profile "moe-ac-$ac" --model 1b-moe --bf16-copies --ac $ac
done
TORCH_LOGS="recompiles,graph_breaks" run moe-acsel-recompiles 1 90 train --dtype bfloat16 --steps 4 \
  --micro-batch-size 4 --model 1b-moe --bf16-copies --ac selective
echo "   recompiles logged: $(grep -c -i 'recompil' "$LOGS/moe-acsel-recompiles.log"), graph breaks: $(grep -c -i 'graph break' "$LOGS/moe-acsel-recompiles.log")"
for ac in selective full; do
  timeout 150 torchrun --nproc_per_node 1 benchmarks/gpu_profile.py --out "$LOGS" --name "moe-prof-$ac" --side playground \
    --last 3 -- train --dtype bfloat16 --steps 8 --micro-batch-size 4 --model 1b-moe --bf16-copies --ac $ac \
    --backend torch --no-progress 2>&1 | grep -v "^W1" > "$LOGS/moe-prof-$ac.log"
  echo "== moe-prof-$ac: $(grep -h -A3 'steady' "$LOGS/moe-prof-$ac.txt" | head -4 | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
done
