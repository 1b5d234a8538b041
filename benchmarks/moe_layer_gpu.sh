#!/usr/bin/env bash
# Where 1b-moe's step time goes beside its dense model's, in one call on one GPU:
# benchmarks/moe_layer_gpu.py (one layer's parts and the optimizer pass, timed and their
# kernels listed), then torch profiles of the training step of 1b-moe and of its dense model
# (`--model-config n_experts=0,d_ff=5472`), both with --bf16-copies, bf16, micro-batch 4
# (benchmarks/gpu_profile.py: host and device time per steady step, the top ops).
# With a first argument ROUNDS > 0 (default 0), first ROUNDS rounds, each in another order, of
# `playground train` (10 steps, the flags above) of 1b-moe (`moe_*`) and its dense model
# (`dense_*`), from this tree (`after`) and from a copy of it whose ZeRO step takes torch's
# AdamW and the copy-back as separate passes (`before`: RunConfig.fused_master_step False).
# PROFILES (default "moe dense") names the profiles to take. Logs and JSON in $LOGS,
# packed into $OUT/gpu_logs.tgz.
set -uo pipefail
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
timeout 240 python benchmarks/moe_layer_gpu.py --json "$LOGS/parts.json" > "$LOGS/parts.log" 2>&1
echo "parts: exit $?"; tail -14 "$LOGS/parts.log"; tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
rounds=${1:-0}
if [ "$rounds" -gt 0 ]; then
  rm -rf /tmp/before && cp -r "$PWD" /tmp/before
  sed -i 's/    fused_master_step: bool = True/    fused_master_step: bool = False/' /tmp/before/playground/run_config.py
  grep -q "fused_master_step: bool = False" /tmp/before/playground/run_config.py || { echo "no before tree"; exit 1; }
fi
train_side() {  # which (moe|dense), tree (after|before), name
  local cfg=(); [ "$1" = dense ] && cfg=(--model-config n_experts=0,d_ff=5472)
  local dir=$PWD; [ "$2" = before ] && dir=/tmp/before
  (cd "$dir" && export PYTHONPATH=$dir && run "$3" 1 240 train --model 1b-moe "${cfg[@]}" --dtype bfloat16 --steps 10 \
    --micro-batch-size 4 --bf16-copies --json "$LOGS/$3.json")
}
orders=("moe:after dense:after moe:before dense:before" "dense:before moe:before dense:after moe:after"
        "moe:before dense:after moe:after dense:before")
for r in $(seq 1 "$rounds"); do
  for side in ${orders[$(( (r - 1) % 3 ))]}; do
    train_side "${side%%:*}" "${side##*:}" "${side%%:*}_${side##*:}_$r"
  done
done
flags=(--dtype bfloat16 --steps 10 --micro-batch-size 4 --bf16-copies --backend torch --no-progress)
profile() {  # name, playground args...
  local name=$1; shift
  timeout 200 torchrun --nproc_per_node 1 benchmarks/gpu_profile.py --out "$LOGS" --name "$name" --side playground \
    -- train "$@" "${flags[@]}" 2>&1 | grep -v "^W1" > "$LOGS/$name.log"
  echo "== $name: $(grep -i 'host:\|device:' "$LOGS/$name.txt" 2>/dev/null | head -2 | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
for which in ${PROFILES:-moe dense}; do
  case $which in
    moe) profile profile_moe --model 1b-moe ;;
    dense) profile profile_dense --model 1b-moe --model-config n_experts=0,d_ff=5472 ;;
  esac
done
