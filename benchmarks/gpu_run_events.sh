#!/usr/bin/env bash
# GPU: the collectives check and 350m DDP / ZeRO-3 / TP throughput after the torch backend
# times CUDA calls with events instead of synchronising (compare with the earlier logs).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_run}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
torchrun --nproc_per_node 2 benchmarks/torchrun_collectives.py --mib 256 --iters 20 2>&1 | grep -v "^W1\|Warning" | tee $OUT/nccl_collectives_events.log | tail -4
for args in "--zero 0" "--zero 3" "--tp 2"; do
  name=$(echo $args | tr -d ' -')
  timeout 120 torchrun --nproc_per_node 2 -m playground train --backend torch --model 350m --dtype bfloat16 $args --steps 20 --micro-batch-size 8 --no-progress 2>&1 | grep -v "^W1\|Warning" > $OUT/train_350m_${name}_events.log
  echo "$args"; grep -E "throughput|peak alloc" $OUT/train_350m_${name}_events.log
done
