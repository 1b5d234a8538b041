#!/usr/bin/env bash
# Activation checkpointing on 2 GPUs (the measured side of benchmarks/ac_gpu.py): the 1b
# preset in bf16 under DDP with --ac none / selective / full at growing micro-batches (a
# run that does not fit ends in an out-of-memory error, logged), and plain PyTorch (torch
# DDP and FSDP2, benchmarks/gpu_side_by_side.py, the same checkpointing) on the same model
# and batch beside the playground's DDP and ZeRO-3, the two sides alternating.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
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
