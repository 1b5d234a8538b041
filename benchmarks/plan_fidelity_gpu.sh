#!/usr/bin/env bash
# The measured side of benchmarks/plan_fidelity.py: the 350m preset in bf16 under torchrun
# on 2 GPUs, in the layouts that script plans (docs: README, "Planning at scale"). Writes
# one train JSON and log per layout under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/plan_fidelity}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
run() {  # name, layout flags...
    local name=$1; shift
    timeout 120 torchrun --nproc_per_node 2 -m playground train --backend torch --model 350m --dtype bfloat16 \
        --steps 12 --no-progress --json "$OUT/$name.json" "$@" 2>&1 | grep -v "^W1" > "$OUT/$name.log"
    grep -h "throughput" "$OUT/$name.log"
}
run dp2 --dp 2 --micro-batch-size 8
run tp2-sp --tp 2 --sp --micro-batch-size 8
run pp2-1f1b --pp 2 --schedule 1f1b --microbatches 8 --micro-batch-size 2
