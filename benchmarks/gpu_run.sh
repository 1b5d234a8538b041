#!/usr/bin/env bash
# The GPU checks of issues 2 and 3, run on a 2-GPU machine (see the closing notes):
# every collective on NCCL against the simulator, a 256 MiB all_reduce's bus bandwidth,
# and DDP training of the 350m preset in bf16 under torchrun. Writes logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/gpu_run}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/gpus.txt"
torchrun --nproc_per_node 2 benchmarks/torchrun_collectives.py --mib 256 --iters 20 2>&1 | grep -v "^W1" | tee "$OUT/collectives.log"
torchrun --nproc_per_node 2 -m playground train --backend torch --model 350m --dtype bfloat16 \
    --steps 30 --micro-batch-size 8 --no-progress 2>&1 | grep -v "^W1" | tee "$OUT/train_350m.log"
