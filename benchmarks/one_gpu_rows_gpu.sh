#!/usr/bin/env bash
# One GPU (an H100 or an H200, whichever is lent): the one-GPU rows of benchmarks/fidelity.py
# measured on it, for plans on its profile (fidelity.py --measured <this run> --hardware <profile>):
# 1b-moe under selective recomputation first (it stopped on an H100 before the policy kept no
# out= output), 1b-moe without and under full recomputation, the dense 1b, `playground
# calibrate` on this one GPU (base the GPU's datasheet profile: what it measures without a second rank,
# the kernels and the host's floor per op; the network stays the base's), 350m, 1b under full
# and selective recomputation. bf16 with compute copies, 10 steps each, --json in $LOGS.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
case $(head -1 "$LOGS/gpus.txt") in *H100*) gpu=h100 ;; *) gpu=h200 ;; esac
c="--dtype bfloat16 --steps 10 --bf16-copies"
run 1b-moe-acsel-b4_single 1 80 train $c --model 1b-moe --micro-batch-size 4 --ac selective --json "$LOGS/1b-moe-acsel-b4_single.json"
run 1b-moe_single 1 70 train $c --model 1b-moe --micro-batch-size 4 --json "$LOGS/1b-moe_single.json"
run 1b-moe-acfull-b4_single 1 70 train $c --model 1b-moe --micro-batch-size 4 --ac full --json "$LOGS/1b-moe-acfull-b4_single.json"
run 1b_single 1 70 train $c --model 1b --micro-batch-size 4 --json "$LOGS/1b_single.json"
timeout 130 torchrun --nproc_per_node 1 -m playground calibrate --backend torch --model 1b --micro-batch-size 4 \
  --base $gpu-datasheet --name $gpu-one-gpu --out "$LOGS/$gpu-one-gpu.json" 2>&1 | grep -v "^W1" > "$LOGS/calibrate.log"
echo "== calibrate (exit ${PIPESTATUS[0]}): $(tail -2 "$LOGS/calibrate.log" | tr '\n' ' ')"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
run 350m_single 1 45 train $c --model 350m --micro-batch-size 8 --json "$LOGS/350m_single.json"
run 1b-acfull-b4_single 1 70 train $c --model 1b --micro-batch-size 4 --ac full --json "$LOGS/1b-acfull-b4_single.json"
run 1b-acsel-b4_single 1 70 train $c --model 1b --micro-batch-size 4 --ac selective --json "$LOGS/1b-acsel-b4_single.json"
