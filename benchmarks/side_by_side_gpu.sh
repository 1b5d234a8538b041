#!/usr/bin/env bash
# The playground against plain PyTorch on the same GPUs, model and batch (bf16): each pair
# runs torch's side (benchmarks/gpu_side_by_side.py) and then the playground's
# (`playground train --backend torch`). Arguments: the pairs to run (default: all of them,
# then one torch-profiler run of each DDP side, benchmarks/gpu_profile.py; `kernels`:
# benchmarks/kernels_gpu.py, the model's element-wise parts before and after; `*_copies`: the
# playground alone with --bf16-copies; `profile_single`: its one-GPU step profiled). Logs and JSON in
# $LOGS, packed into $OUT/gpu_logs.tgz; benchmarks/side_by_side.py tabulates them.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
torch_side() {  # name, nproc, args...
  local name=$1 n=$2; shift 2
  timeout 240 torchrun --nproc_per_node "$n" benchmarks/gpu_side_by_side.py --steps 10 --json "$LOGS/$name.json" "$@" \
    2>&1 | grep -v "^W1" > "$LOGS/$name.log"
  echo "== $name: $(tail -1 "$LOGS/$name.log" | cut -c1-260)"
}
pg() {  # name, nproc, args...
  local name=$1 n=$2; shift 2
  run "$name" "$n" 240 train --dtype bfloat16 --steps 10 --json "$LOGS/$name.json" "$@"
}
pair() {
  case $1 in
    ddp_1b) torch_side torch_ddp_1b_b8 2 --mode ddp --model 1b --mbs 8
            pg pg_ddp_1b_b8 2 --model 1b --dp 2 --micro-batch-size 8 ;;
    zero3_1b) torch_side torch_fsdp2_1b_b8 2 --mode fsdp2 --model 1b --mbs 8
              pg pg_zero3_1b_b8 2 --model 1b --dp 2 --zero 3 --micro-batch-size 8 ;;
    ddp_350m) torch_side torch_ddp_350m_b8 2 --mode ddp --model 350m --mbs 8
              pg pg_ddp_350m_b8 2 --model 350m --dp 2 --micro-batch-size 8 ;;
    single_1b) torch_side torch_single_1b_b4 1 --mode single --model 1b --mbs 4
               pg pg_single_1b_b4 1 --model 1b --micro-batch-size 4 ;;
    single_1b_compile) torch_side torch_single_1b_b4_compile 1 --mode single --model 1b --mbs 4 --compile
                       pg pg_single_1b_b4_compile 1 --model 1b --micro-batch-size 4 --compile ;;
    single_1b_copies) pg pg_single_1b_b4_copies 1 --model 1b --micro-batch-size 4 --bf16-copies ;;
    single_1b_compile_copies) pg pg_single_1b_b4_compile_copies 1 --model 1b --micro-batch-size 4 --bf16-copies --compile ;;
    profile_single) timeout 150 torchrun --nproc_per_node 1 benchmarks/gpu_profile.py --out "$LOGS" \
                      --name profile_playground_single_1b_b4 --side playground -- train --model 1b --micro-batch-size 4 \
                      --bf16-copies --dtype bfloat16 --steps 4 --backend torch --no-progress 2>&1 | grep -v "^W1" \
                      > "$LOGS/profile_single.log"
                    echo "== profile single: $(head -2 "$LOGS/profile_playground_single_1b_b4.txt" | tail -1)" ;;
    kernels) timeout 120 python benchmarks/kernels_gpu.py --model 1b --micro-batch-size 4 --json "$LOGS/kernels.json" \
               2>&1 | tee "$LOGS/kernels.log" ;;
    profile) for side in torch playground; do
               if [ $side = torch ]; then args="--mode ddp --model 1b --mbs 8 --steps 6"
               else args="train --model 1b --dp 2 --micro-batch-size 8 --dtype bfloat16 --steps 6 --backend torch --no-progress"; fi
               timeout 150 torchrun --nproc_per_node 2 benchmarks/gpu_profile.py --out "$LOGS" \
                 --name "profile_${side}_ddp_1b_b8" --side $side -- $args 2>&1 | grep -v "^W1" > "$LOGS/profile_${side}.log"
               echo "== profile $side: $(head -2 "$LOGS/profile_${side}_ddp_1b_b8.txt" | tail -1)"
             done ;;
    *) echo "unknown pair $1"; exit 2 ;;
  esac
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
for p in "${@:-ddp_1b zero3_1b ddp_350m single_1b profile}"; do for q in $p; do pair "$q"; done; done
