#!/usr/bin/env bash
# GPU checks on a 2-GPU machine: the equivalence check of every pipeline
# schedule over NCCL point-to-point (pp=2, float32, the small preset so that interleaved
# has two chunks per rank), then the 350m preset trained in bf16 with pp=2 under 1F1B and
# ZB-H1. Writes logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_run}; mkdir -p "$OUT"
for s in "gpipe" "1f1b" "zb1" "interleaved --virtual-stages 2"; do
  name=$(echo $s | cut -d' ' -f1)
  timeout 100 torchrun --nproc_per_node 2 -m playground check --backend torch --model small --pp 2 --microbatches 4 \
      --micro-batch-size 2 --schedule $s --dtype float32 2>&1 | grep -v "^W1" | tail -3 | tee "$OUT/check_pp2_$name.log"
done
for s in 1f1b zb1; do
  timeout 150 torchrun --nproc_per_node 2 -m playground train --backend torch --model 350m --dtype bfloat16 --pp 2 \
      --schedule $s --microbatches 8 --micro-batch-size 2 --steps ${STEPS:-20} --no-progress 2>&1 | grep -v "^W1" \
      | tee "$OUT/train_350m_pp2_$s.log"
done
