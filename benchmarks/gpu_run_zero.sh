#!/usr/bin/env bash
# GPU checks on a 2-GPU machine: the equivalence check of ZeRO stages 1-3
# on NCCL (float32, two microbatches), then the 350m preset trained in bf16 under DDP and
# under ZeRO-1/2/3 (tokens/s, model states per rank from the tensors, and the CUDA peak
# allocated). Writes logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_run}; mkdir -p "$OUT"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())" | tee "$OUT/gpus.txt"
for z in 1 2 3; do
  torchrun --nproc_per_node 2 -m playground check --backend torch --zero $z --dtype float32 --microbatches 2 \
      2>&1 | grep -v "^W1" | tail -3 | tee "$OUT/check_zero$z.log"
done
for z in 0 1 2 3; do
  timeout 150 torchrun --nproc_per_node 2 -m playground train --backend torch --model 350m --dtype bfloat16 --zero $z \
      --steps ${STEPS:-20} --micro-batch-size 8 --no-progress 2>&1 | grep -v "^W1" | tee "$OUT/train_350m_zero$z.log"
done
