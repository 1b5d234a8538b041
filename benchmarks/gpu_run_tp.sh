#!/usr/bin/env bash
# GPU checks on a 2-GPU machine: the equivalence check of tensor
# parallelism (tp=2, with and without sequence parallelism) on NCCL, then the 350m preset
# trained in bf16 with tp=2 and tp=2 + SP. Writes logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_run}; mkdir -p "$OUT"
for sp in "" "--sp"; do
  torchrun --nproc_per_node 2 -m playground check --backend torch --tp 2 $sp --dtype float32 --microbatches 2 \
      2>&1 | grep -v "^W1" | tail -3 | tee "$OUT/check_tp2$sp.log"
done
for sp in "" "--sp"; do
  timeout 150 torchrun --nproc_per_node 2 -m playground train --backend torch --model 350m --dtype bfloat16 --tp 2 $sp \
      --steps ${STEPS:-20} --micro-batch-size 8 --no-progress 2>&1 | grep -v "^W1" | tee "$OUT/train_350m_tp2$sp.log"
done
