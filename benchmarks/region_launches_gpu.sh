#!/usr/bin/env bash
# One GPU (an H100 or an H200, whichever is lent): what a compiled region costs the host per
# call (benchmarks/region_launches_gpu.py), then the whole steps a host model of compiled
# regions is checked on: 1b-dsmoe (its MoE layer a region the fit never saw at a step) and
# 1b-moe without, under full and under selective recomputation (a third run of each beside
# run70 and run71, for medians). Then `playground calibrate` on the same host (its kernel and
# selective floors: the host's issuing differs between lent machines of one kind). bf16 with compute copies, 10 steps each, --json in $LOGS.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
case $(head -1 "$LOGS/gpus.txt") in *H100*) gpu=h100 ;; *) gpu=h200 ;; esac
timeout 240 python benchmarks/region_launches_gpu.py --json "$LOGS/region_launches.json" > "$LOGS/region_launches.log" 2>&1
echo "== region_launches (exit $?)"; tail -10 "$LOGS/region_launches.log"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
c="--dtype bfloat16 --steps 10 --bf16-copies"
run 1b-dsmoe_single 1 80 train $c --model 1b-dsmoe --micro-batch-size 4 --json "$LOGS/1b-dsmoe_single.json"
run 1b-moe_single 1 70 train $c --model 1b-moe --micro-batch-size 4 --json "$LOGS/1b-moe_single.json"
run 1b-moe-acfull-b4_single 1 70 train $c --model 1b-moe --micro-batch-size 4 --ac full --json "$LOGS/1b-moe-acfull-b4_single.json"
run 1b-moe-acsel-b4_single 1 80 train $c --model 1b-moe --micro-batch-size 4 --ac selective --json "$LOGS/1b-moe-acsel-b4_single.json"
timeout 130 torchrun --nproc_per_node 1 -m playground calibrate --backend torch --model 1b --micro-batch-size 4 \
    --base $gpu-datasheet --name $gpu-one-gpu --out "$LOGS/$gpu-one-gpu.json" 2>&1 | grep -v "^W1" > "$LOGS/calibrate.log"
echo "== calibrate (exit ${PIPESTATUS[0]}): $(tail -2 "$LOGS/calibrate.log" | tr '\n' ' ')"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
