#!/usr/bin/env bash
# The playground against plain PyTorch on the same GPUs, model and batch (bf16): each pair
# runs torch's side (benchmarks/gpu_side_by_side.py) and then the playground's
# (`playground train --backend torch`). Arguments: the pairs to run (default: all of them,
# then one torch-profiler run of each DDP side, benchmarks/gpu_profile.py; `kernels`:
# benchmarks/kernels_gpu.py, the model's element-wise parts before and after; `*_copies`: the
# playground alone with --bf16-copies (the default since; the torch-against-playground pairs give the
# playground --autocast, torch's side's recipe); `ddp_350m_copies[_2]`: torch DDP under autocast beside the playground's
# with --bf16-copies, _2 in the other order; `single_1b_b8*`, `single_1b_b16*`: one GPU at micro-batch 8, 16; `zero3_w1`: FSDP2 and ZeRO-3 on one GPU; `single_350m`, `profile_350m_single`: one GPU at 350m, and its profiles; `profile_single`: its one-GPU step profiled;
# `profile_layouts`: steady-state profiles of layouts, gpu_profile.py). Logs and JSON in
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
            pg pg_ddp_1b_b8 2 --model 1b --dp 2 --micro-batch-size 8 --autocast ;;
    zero3_1b) torch_side torch_fsdp2_1b_b8 2 --mode fsdp2 --model 1b --mbs 8
              pg pg_zero3_1b_b8 2 --model 1b --dp 2 --zero 3 --micro-batch-size 8 ;;
    ddp_350m) torch_side torch_ddp_350m_b8 2 --mode ddp --model 350m --mbs 8
              pg pg_ddp_350m_b8 2 --model 350m --dp 2 --micro-batch-size 8 --autocast ;;
    ddp_350m_copies) torch_side torch_ddp_350m_b8_copies 2 --mode ddp --model 350m --mbs 8
                     pg pg_ddp_350m_b8_copies 2 --model 350m --dp 2 --micro-batch-size 8 --bf16-copies ;;
    ddp_350m_copies_2) pg pg_ddp_350m_b8_copies_2 2 --model 350m --dp 2 --micro-batch-size 8 --bf16-copies
                       torch_side torch_ddp_350m_b8_copies_2 2 --mode ddp --model 350m --mbs 8 ;;  # (the other order)
    single_1b) torch_side torch_single_1b_b4 1 --mode single --model 1b --mbs 4
               pg pg_single_1b_b4 1 --model 1b --micro-batch-size 4 --autocast ;;
    single_1b_compile) torch_side torch_single_1b_b4_compile 1 --mode single --model 1b --mbs 4 --compile
                       pg pg_single_1b_b4_compile 1 --model 1b --micro-batch-size 4 --compile --autocast ;;
    single_1b_b8) torch_side torch_single_1b_b8 1 --mode single --model 1b --mbs 8
                  pg pg_single_1b_b8 1 --model 1b --micro-batch-size 8 --autocast ;;
    single_1b_b8_copies) pg pg_single_1b_b8_copies 1 --model 1b --micro-batch-size 8 --bf16-copies ;;
    zero3_w1) for m in 1b 350m; do  # one GPU: FSDP2 over a world of 1 beside ZeRO-3 at dp 1 (the same memory structure)
                torch_side torch_fsdp2_${m}_b8_w1 1 --mode fsdp2 --model $m --mbs 8
                pg pg_zero3_${m}_b8_w1 1 --model $m --zero 3 --micro-batch-size 8
              done ;;
    single_350m) torch_side torch_single_350m_b8 1 --mode single --model 350m --mbs 8
                 pg pg_single_350m_b8 1 --model 350m --micro-batch-size 8 --autocast ;;
    profile_350m_single) for side in torch playground; do  # the steady state of each side's one-GPU 350m step
                           if [ $side = torch ]; then args="--mode single --model 350m --mbs 8 --steps 8"
                           else args="train --model 350m --micro-batch-size 8 --dtype bfloat16 --steps 8 --backend torch --no-progress --autocast"; fi
                           timeout 150 torchrun --nproc_per_node 1 benchmarks/gpu_profile.py --out "$LOGS" \
                             --name "profile_${side}_single_350m_b8" --side $side -- $args 2>&1 | grep -v "^W1" \
                             > "$LOGS/profile_${side}_350m.log"
                           echo "== profile $side: $(sed -n 5,7p "$LOGS/profile_${side}_single_350m_b8.txt" | tr '\n' ' ')"
                         done ;;
    single_1b_b16) torch_side torch_single_1b_b16 1 --mode single --model 1b --mbs 16
                   pg pg_single_1b_b16 1 --model 1b --micro-batch-size 16 ;;
    single_1b_b16_copies) pg pg_single_1b_b16_copies 1 --model 1b --micro-batch-size 16 --bf16-copies ;;
    single_1b_b8_compile) torch_side torch_single_1b_b8_compile 1 --mode single --model 1b --mbs 8 --compile
                          pg pg_single_1b_b8_compile 1 --model 1b --micro-batch-size 8 --compile ;;
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
               else args="train --model 1b --dp 2 --micro-batch-size 8 --dtype bfloat16 --steps 6 --backend torch --no-progress --autocast"; fi
               timeout 150 torchrun --nproc_per_node 2 benchmarks/gpu_profile.py --out "$LOGS" \
                 --name "profile_${side}_ddp_1b_b8" --side $side -- $args 2>&1 | grep -v "^W1" > "$LOGS/profile_${side}.log"
               echo "== profile $side: $(head -2 "$LOGS/profile_${side}_ddp_1b_b8.txt" | tail -1)"
             done ;;
    profile_layouts) prof() {  # name, nproc, side, args...: one steady-state profile (gpu_profile.py)
                       local name=$1 n=$2 side=$3; shift 3
                       timeout 200 torchrun --nproc_per_node "$n" benchmarks/gpu_profile.py --out "$LOGS" --name "$name" \
                         --side "$side" -- "$@" 2>&1 | grep -v "^W1" > "$LOGS/$name.log"
                       echo "== $name: $(sed -n 5,7p "$LOGS/$name.txt" | tr '\n' ' ')"
                       tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
                     }
                     t="--dtype bfloat16 --steps 8 --backend torch --no-progress --bf16-copies"
                     prof profile_pg_1b_single 1 playground train --model 1b --micro-batch-size 4 $t
                     prof profile_pg_1b_tp2 2 playground train --model 1b --micro-batch-size 4 --tp 2 $t
                     prof profile_pg_1b_tp2-sp 2 playground train --model 1b --micro-batch-size 4 --tp 2 --sp $t
                     prof profile_pg_1b_cp2 2 playground train --model 1b --micro-batch-size 4 --cp 2 $t
                     prof profile_pg_350m_dp2 2 playground train --model 350m --micro-batch-size 8 --dp 2 $t
                     prof profile_torch_350m_ddp 2 torch --mode ddp --model 350m --mbs 8 --steps 8 ;;
    *) echo "unknown pair $1"; exit 2 ;;
  esac
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
for p in "${@:-ddp_1b zero3_1b ddp_350m single_1b profile}"; do for q in $p; do pair "$q"; done; done
