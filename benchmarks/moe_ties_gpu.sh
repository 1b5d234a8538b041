#!/usr/bin/env bash
# Exact bf16 ties in the routing on one CUDA GPU (run through the device tool): how often
# torch.topk and the stable-sort top-k (model.moe.top_k) choose other experts on CUDA than on
# the CPU for the same scores (benchmarks/topk_ties_gpu.py); the bf16 MoE checks that failed
# on a routing PROBLEM with torch.topk, now with the stable sort, through the layer's one
# compiled region and through three (benchmarks/moe_variant.py three-regions), and with
# torch.topk put back (the failure reproduced); and 1b-moe and 1b-dsmoe trained in bf16 with
# either top-k (the sort's cost). `bash benchmarks/moe_ties_gpu.sh checks` or `... train` (each
# within one device call). Logs go to $OUT/gpu_logs.tgz; one verdict line each.
set -u
source benchmarks/gpu_common.sh
if [ "${1:-checks}" = checks ]; then
python benchmarks/topk_ties_gpu.py --json "$LOGS/topk_ties.json" 2>&1 | tee "$LOGS/topk_ties.log"
CHECK=(--steps 3 --micro-batch-size 2)
run check_moe_bf16 1 240 check --model tiny-moe --dtype bfloat16 "${CHECK[@]}"
run check_dsmoe_bf16 1 240 check --model tiny-dsmoe --dtype bfloat16 "${CHECK[@]}"
run check_dsmoe_bf16_autocast 1 240 check --model tiny-dsmoe --dtype bfloat16 --autocast "${CHECK[@]}"
LAUNCH="benchmarks/moe_variant.py three-regions --" run three_check_dsmoe_bf16 1 240 check --model tiny-dsmoe \
  --dtype bfloat16 "${CHECK[@]}"
LAUNCH="benchmarks/moe_variant.py torch-topk --" run topk_check_dsmoe_bf16 1 240 check --model tiny-dsmoe \
  --dtype bfloat16 "${CHECK[@]}"
run check_dsmoe_bf16_long 1 300 check --model tiny-dsmoe --dtype bfloat16 --steps 6 --micro-batch-size 4
run check_moe_bf16_long 1 300 check --model tiny-moe --dtype bfloat16 --steps 6 --micro-batch-size 4
else
TRAIN=(--dtype bfloat16 --micro-batch-size 4 --steps 12)
for i in 1 2; do
  for m in 1b-moe 1b-dsmoe; do
    # (named as benchmarks/fidelity.py's rows of these layouts, which these then replace; old_: not compared)
    run "${m}_1gpu_$i" 1 300 train --model $m "${TRAIN[@]}" --json "$LOGS/${m}_1gpu_$i.json"
    LAUNCH="benchmarks/moe_variant.py torch-topk --" run "old_topk_${m}_$i" 1 300 train --model $m "${TRAIN[@]}" \
      --json "$LOGS/old_topk_${m}_$i.json"
  done
done
fi
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
