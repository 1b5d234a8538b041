#!/usr/bin/env bash
# Activation checkpointing on GPUs (the measured side of benchmarks/ac_gpu.py). With the
# argument `single`, on one GPU: the 1b preset in bf16 (--bf16-copies, the mixed precision a
# plan prices) with --ac none / selective / full, each at the largest micro-batch that
# `playground plan` on the h200 profile fits in 92% of the device's memory (32, 40, 80; if
# the allocator's fragmentation leaves 32 out of memory, 28 after it), and
# selective and full at micro-batch 4 beside the one-GPU rows of benchmarks/fidelity.py;
# named MODEL-acMODE-bMBS_single as fidelity.py reads them. Without it, on 2 GPUs: the
# 1b preset in bf16 under DDP at growing micro-batches (a run that does not fit ends in an
# out-of-memory error, logged), and plain PyTorch (torch DDP and FSDP2,
# benchmarks/gpu_side_by_side.py, the same checkpointing) on the same model and batch beside
# the playground's DDP and ZeRO-3, the two sides alternating.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
if [ "${1:-}" = single ]; then
  for r in none:32 none:28 selective:40 full:80 selective:4 full:4; do
    [ "$r" = none:28 ] && [ -f "$LOGS/1b-acnone-b32_single.json" ] && continue
    run "1b-ac${r%:*}-b${r#*:}_single" 1 300 train --model 1b --dtype bfloat16 --bf16-copies --steps 8 \
      --ac "${r%:*}" --micro-batch-size "${r#*:}" --json "$LOGS/1b-ac${r%:*}-b${r#*:}_single.json"
  done
  exit 0
fi
torch_side() {  # name, args...
  local name=$1; shift
  timeout 240 torchrun --nproc_per_node 2 benchmarks/gpu_side_by_side.py --model 1b --steps 8 \
    --json "$LOGS/$name.json" "$@" 2>&1 | grep -v "^W1" > "$LOGS/$name.log"
  echo "== $name: $(tail -1 "$LOGS/$name.log" | cut -c1-300)"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
pg() {  # name, args...
  local name=$1; shift
  run "$name" 2 240 train --model 1b --dtype bfloat16 --steps 8 --json "$LOGS/$name.json" "$@"
}
torch_side torch_ddp_none_b8 --mode ddp --mbs 8 --ac none
pg pg_ddp_none_b8 --dp 2 --micro-batch-size 8 --ac none
torch_side torch_fsdp2_none_b8 --mode fsdp2 --mbs 8 --ac none
pg pg_zero3_none_b8 --dp 2 --zero 3 --micro-batch-size 8 --ac none
torch_side torch_ddp_full_b32 --mode ddp --mbs 32 --ac full
pg pg_ddp_full_b32 --dp 2 --micro-batch-size 32 --ac full
pg pg_ddp_selective_b16 --dp 2 --micro-batch-size 16 --ac selective
pg pg_ddp_none_b16 --dp 2 --micro-batch-size 16 --ac none
pg pg_ddp_selective_b32 --dp 2 --micro-batch-size 32 --ac selective
pg pg_ddp_none_b24 --dp 2 --micro-batch-size 24 --ac none
pg pg_ddp_full_b64 --dp 2 --micro-batch-size 64 --ac full
