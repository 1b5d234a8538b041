#!/usr/bin/env bash
# The mixture of experts at GPU speed, on one GPU, in one call: `playground train` of the
# 1b-moe preset (bf16, micro-batch 4) at an earlier tree (DIR: `git archive COMMIT | tar -x
# -C DIR`) and at this one, beside a dense model with the same active FLOPs per token (the
# preset without experts, d_ff twice the experts': 2.12 GFLOP per token either way), ROUNDS
# rounds (default 3), each running the three in turn, the next round in another order; then
# a torch profile of each (benchmarks/gpu_profile.py: host and device time per steady step)
# and the host syncs of one MoE layer's forward and backward on this tree (CUDA's sync debug
# mode, which warns at each). DIR "-": no earlier tree. A third argument, a comma-separated
# list, adds: `compile`, COMPILE_ROUNDS (default 1) alternated rounds of each model with
# --compile (each block's body through torch.compile), and a profile of each; `dsmoe`, two rounds of 1b-dsmoe (16 experts of half the width, top-4, one
# shared) against its dense model of the same active FLOPs (d_ff 5 × 1368 = 6840). With
# INDUCTOR="NAME=VALUE ...", each round also runs this tree with those TorchInductor options
# (`ind`: benchmarks/with_inductor.py), profiled too. Logs and JSON
# in $LOGS, packed into $OUT/gpu_logs.tgz; benchmarks/gpu_runs.py packs them for the
# repository.
set -uo pipefail
old=$([ "$1" = - ] && echo - || (cd "$1" && pwd)); rounds=${2:-3}; extra=${3:-}
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
flags=(--dtype bfloat16 --steps 10 --micro-batch-size 4)
side() {  # which (old|moe|dense), name
  case $1 in
    ds) run "$2" 1 300 train --model 1b-dsmoe "${flags[@]}" --json "$LOGS/$2.json" ;;
    dsdense) run "$2" 1 240 train --model 1b-dsmoe --model-config n_experts=0,d_ff=6840 "${flags[@]}" \
               --json "$LOGS/$2.json" ;;
    old) (cd "$old" && export PYTHONPATH="$old" && run "$2" 1 240 train --model 1b-moe "${flags[@]}" --json "$LOGS/$2.json") ;;
    moe) run "$2" 1 240 train --model 1b-moe "${flags[@]}" --json "$LOGS/$2.json" ;;
    dense) run "$2" 1 240 train --model 1b-moe --model-config n_experts=0,d_ff=5472 "${flags[@]}" --json "$LOGS/$2.json" ;;
    ind) LAUNCH="$ind" run "$2" 1 300 train --model 1b-moe "${flags[@]}" --json "$LOGS/$2.json" ;;
  esac
}
orders=("old moe dense" "dense moe old" "moe old dense")
ind="benchmarks/with_inductor.py ${INDUCTOR:-} --"
for r in $(seq 1 "$rounds"); do
  order=${orders[$(( (r - 1) % 3 ))]}
  if [ -n "${INDUCTOR:-}" ]; then order=$( (( r % 2 )) && echo "ind $order" || echo "$order ind"); fi
  for which in $order; do
    [ "$which" = old ] && [ "$old" = - ] && continue
    side "$which" "${which}_$r"
  done
done
if [[ ",$extra," == *,dsmoe,* ]]; then
  for which in ds dsdense dsdense ds; do
    n=$(ls "$LOGS" | grep -c "^${which}_[0-9]*.log$"); side "$which" "${which}_$((n + 1))"
  done
fi
if [[ ",$extra," == *,compile,* ]]; then
  for r in $(seq 1 "${COMPILE_ROUNDS:-1}"); do
    order=$( (( r % 2 )) && echo "moe dense" || echo "dense moe")
    for which in $order; do
      case $which in
        moe) run "moe_compile_$r" 1 300 train --model 1b-moe "${flags[@]}" --compile --json "$LOGS/moe_compile_$r.json" ;;
        dense) run "dense_compile_$r" 1 300 train --model 1b-moe --model-config n_experts=0,d_ff=5472 "${flags[@]}" \
                 --compile --json "$LOGS/dense_compile_$r.json" ;;
      esac
    done
  done
fi
profile() {  # tree, name, playground args... (PROFILE_LAUNCH: what runs gpu_profile.py, if set)
  local tree=$1 name=$2; shift 2
  (cd "$tree" && export PYTHONPATH="$tree" && timeout 240 torchrun --nproc_per_node 1 ${PROFILE_LAUNCH:-} benchmarks/gpu_profile.py \
     --out "$LOGS" --name "$name" --side playground -- train "$@" "${flags[@]}" --backend torch --no-progress \
     2>&1 | grep -v "^W1" > "$LOGS/$name.log")
  echo "== $name: $(grep -i 'per step\|host' "$LOGS/$name.txt" 2>/dev/null | head -3 | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
profile "$PWD" profile_moe --model 1b-moe
if [[ ",$extra," == *,compile,* ]]; then
  profile "$PWD" profile_moe_compile --model 1b-moe --compile
  profile "$PWD" profile_dense_compile --model 1b-moe --model-config n_experts=0,d_ff=5472 --compile
fi
[ -n "${INDUCTOR:-}" ] && PROFILE_LAUNCH="$ind" profile "$PWD" profile_ind --model 1b-moe
[ "$old" = - ] || profile "$old" profile_old --model 1b-moe
[ "$old" = - ] || profile "$PWD" profile_dense --model 1b-moe --model-config n_experts=0,d_ff=5472
python - > "$LOGS/syncs.log" 2>&1 <<'PY'
import dataclasses
import warnings
import torch
from model import preset
from model.moe import MoE
cfg = preset("1b-moe")
layer = MoE(cfg).cuda()
for p in layer.parameters():
    torch.nn.init.normal_(p, std=0.02)
x = torch.randn(4, cfg.seq_len, cfg.d_model, device="cuda", requires_grad=True)
for mode in ("dropless", "capacity"):
    layer.config = cfg if mode == "capacity" else dataclasses.replace(cfg, capacity_factor=0.0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x).float().sum().backward()  # (warm-up)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(x).float().sum().backward()
    torch.cuda.set_sync_debug_mode(0)
    print(f"{mode}: {len(caught)} host syncs in one MoE layer's forward and backward")
    for w in caught:
        print("   ", str(w.message).splitlines()[0][:160])
PY
cat "$LOGS/syncs.log" | grep "host syncs"
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
