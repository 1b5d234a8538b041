#!/usr/bin/env bash
# The measured side of benchmarks/fidelity.py on 2 GPUs. Arguments: the sets to run
# (default: all): `calibrate` (playground calibrate: the profile $LOGS/h200.json), `350m`
# and `1b` (each layout trained 10 steps in bf16 under torchrun with --json; layouts without
# ZeRO with --bf16-copies, the mixed precision a plan prices), or `350m:tp2,cp2` for some
# of them, `moe` (1b-moe, ep 2), `unfused` (one GPU: 1b and 350m with attention=unfused
# beside the flash kernel), `dropout` (one GPU: tests/test_dropout.py on CUDA; 1b and 350m with
# attention dropout 0.1 beside unfused attention without it, and 1b with it under full
# checkpointing), `zero3-w1` (one GPU: 1b and 350m under ZeRO-3 at dp 1), `check` (the NCCL collectives against the simulator, and
# `playground check` of tp 2 + SP and pp 2). Logs and JSON in $LOGS, packed into
# $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
layouts() {  # model, micro-batch size, the layouts (default: all)
  local m=$1 b=$2 only=",${3:-single,dp2,zero1,zero3,tp2,tp2-sp,pp2-1f1b,pp2-zb1,cp2},"
  local c="--dtype bfloat16 --steps 10 --model $1"
  run() { case $only in *",${1#*_},"*) command_run "$@" ;; esac; }
  run "${m}_single" 1 200 train $c --bf16-copies --micro-batch-size "$b" --json "$LOGS/${m}_single.json"
  run "${m}_dp2" 2 200 train $c --bf16-copies --dp 2 --micro-batch-size "$b" --json "$LOGS/${m}_dp2.json"
  run "${m}_zero1" 2 200 train $c --dp 2 --zero 1 --micro-batch-size "$b" --json "$LOGS/${m}_zero1.json"
  run "${m}_zero3" 2 200 train $c --dp 2 --zero 3 --micro-batch-size "$b" --json "$LOGS/${m}_zero3.json"
  run "${m}_tp2" 2 200 train $c --bf16-copies --tp 2 --micro-batch-size "$b" --json "$LOGS/${m}_tp2.json"
  run "${m}_tp2-sp" 2 200 train $c --bf16-copies --tp 2 --sp --micro-batch-size "$b" --json "$LOGS/${m}_tp2-sp.json"
  run "${m}_pp2-1f1b" 2 200 train $c --bf16-copies --pp 2 --microbatches 8 --micro-batch-size $((b / 2)) \
    --json "$LOGS/${m}_pp2-1f1b.json"
  run "${m}_pp2-zb1" 2 200 train $c --bf16-copies --pp 2 --schedule zb1 --microbatches 8 --micro-batch-size $((b / 2)) \
    --json "$LOGS/${m}_pp2-zb1.json"
  run "${m}_cp2" 2 200 train $c --bf16-copies --cp 2 --micro-batch-size "$b" --json "$LOGS/${m}_cp2.json"
}
eval "command_run() $(declare -f run | tail -n +2)"  # gpu_common.sh's run, under another name
for s in "${@:-calibrate 350m 1b moe}"; do for t in $s; do
  case $t in
    350m:*) layouts 350m 8 "${t#*:}" ;;
    1b:*) layouts 1b 4 "${t#*:}" ;;
    check) timeout 120 torchrun --nproc_per_node 2 benchmarks/torchrun_collectives.py 2>&1 | grep -v "^W1" \
             > "$LOGS/collectives.log"; tail -3 "$LOGS/collectives.log"
           command_run check_tp2-sp 2 200 check --model small --tp 2 --sp
           command_run check_pp2-zb1 2 200 check --model small --pp 2 --schedule zb1 --microbatches 4 ;;
    calibrate) timeout 300 torchrun --nproc_per_node 2 -m playground calibrate --backend torch --model 1b \
                 --micro-batch-size 4 --base h200-datasheet --name h200 --out "$LOGS/h200.json" 2>&1 | grep -v "^W1" \
                 > "$LOGS/calibrate.log"; cat "$LOGS/calibrate.log" | head -20
               tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" . ;;
    350m) layouts 350m 8 ;;
    1b) layouts 1b 4 ;;
    unfused) for m in 1b:4 350m:8; do  # attention="unfused" (Megatron-LM's of 2021) beside the flash kernel
               command_run "${m%:*}_single" 1 200 train --dtype bfloat16 --steps 10 --model "${m%:*}" --bf16-copies \
                 --micro-batch-size "${m#*:}" --json "$LOGS/${m%:*}_single.json"
               command_run "${m%:*}-unfused_single" 1 200 train --dtype bfloat16 --steps 10 --model "${m%:*}" \
                 --model-config attention=unfused --bf16-copies --micro-batch-size "${m#*:}" \
                 --json "$LOGS/${m%:*}-unfused_single.json"
             done ;;
    dropout) python -m pytest -q -p no:cacheprovider tests/test_dropout.py > "$LOGS/test_dropout_cuda.log" 2>&1
             tail -1 "$LOGS/test_dropout_cuda.log"
             for m in 1b:4 350m:8; do  # attention dropout 0.1 (Megatron-LM's default) beside unfused attention without it
               for v in unfused:attention=unfused dropout:attention=unfused,attention_dropout=0.1; do
                 command_run "${m%:*}-${v%%:*}_single" 1 200 train --dtype bfloat16 --steps 10 --model "${m%:*}" \
                   --model-config "${v#*:}" --bf16-copies --micro-batch-size "${m#*:}" --json "$LOGS/${m%:*}-${v%%:*}_single.json"
               done
             done
             command_run 1b-dropout-acfull_single 1 200 train --dtype bfloat16 --steps 10 --model 1b --ac full \
               --model-config attention=unfused,attention_dropout=0.1 --bf16-copies --micro-batch-size 4 \
               --json "$LOGS/1b-dropout-acfull_single.json" ;;
    zero3-w1) for m in 1b:4 350m:8; do  # ZeRO-3 on one GPU (dp 1): the engine's memory, as a 2-GPU run has it
                command_run "${m%:*}_zero3-w1" 1 200 train --dtype bfloat16 --steps 10 --model "${m%:*}" --zero 3 \
                  --micro-batch-size "${m#*:}" --json "$LOGS/${m%:*}_zero3-w1.json"
              done ;;
    moe) command_run 1b-moe_ep2 2 200 train --dtype bfloat16 --steps 10 --model 1b-moe --bf16-copies --ep 2 --dp 2 \
           --micro-batch-size 4 --json "$LOGS/1b-moe_ep2.json" ;;
    *) echo "unknown set $t"; exit 2 ;;
  esac
done; done
