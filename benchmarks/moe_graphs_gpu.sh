#!/usr/bin/env bash
# The MoE layer's CUDA graphs on one GPU, in one call: benchmarks/moe_graphs_gpu.py (the
# graphed layers against their compiled region: bitwise, and the time of a stack of them);
# then `playground train` of 1b-moe (bf16 autocast, micro-batch 4, 10 steps) as its compiled
# regions (`moe`), with --cuda-graphs (`graphs`) and its dense model of the same active FLOPs
# (`dense`: no experts, d_ff 5472), ROUNDS rounds (default 3) in turn, each round in another
# order; then a torch profile of `graphs` and of `moe` (benchmarks/gpu_profile.py: host and
# device time per steady step). A second argument, a comma-separated list, adds: `copies`,
# one run of `graphs` with --bf16-copies (as benchmarks/fidelity.py's rows run), `copies2` one
# of `moe` so; `noprofile` leaves out both profiles, `noprofile2` the profile of `moe`; `nolayers` the
# layers' check; `dsmoe`, 1b-dsmoe with and without --cuda-graphs and its dense model (d_ff 6840);
# `deviceonly`, 12 steps of each with the device alone recorded over 5 of them
# (benchmarks/gpu_profile.py --device-only: no host op recorded, so the host runs as unprofiled):
# 1b-moe with --bf16-copies --cuda-graphs and its dense model with --bf16-copies twice in turn, then
# once 1b-moe with --bf16-copies, and the autocast command graphed and not; `gaps`, the same record
# of 1b-moe with --bf16-copies --cuda-graphs, its dense model and the first with --on-nan off, twice
# in turn (NAME.txt then says where in the step the device idles and which kernels it waits for).
# Logs and JSON in $LOGS, packed into $OUT/gpu_logs.tgz.
set -uo pipefail
rounds=${1:-3}; extra=${2:-}
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
if [[ ",$extra," != *,nolayers,* ]]; then
  timeout 240 python benchmarks/moe_graphs_gpu.py --json "$LOGS/layers.json" > "$LOGS/layers.log" 2>&1
  status=$?; tail -8 "$LOGS/layers.log"; tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
  [ "$status" = 0 ] || { echo "the layers' check failed (exit $status): nothing else run"; exit 1; }
fi
flags=(--dtype bfloat16 --steps 10 --micro-batch-size 4)
# (compute copies are bf16's default; `withcopies` says so, else these run the autocast they measured)
if [[ ",$extra," == *,withcopies,* ]]; then flags+=(--bf16-copies); else flags+=(--autocast); fi
side() {  # which, name
  case $1 in
    moe) run "$2" 1 240 train --model 1b-moe "${flags[@]}" --json "$LOGS/$2.json" ;;
    graphs) run "$2" 1 240 train --model 1b-moe "${flags[@]}" --cuda-graphs --json "$LOGS/$2.json" ;;
    dense) run "$2" 1 240 train --model 1b-moe --model-config n_experts=0,d_ff=5472 "${flags[@]}" --json "$LOGS/$2.json" ;;
    graphs_copies) run "$2" 1 240 train --model 1b-moe "${flags[@]/--autocast/--bf16-copies}" --cuda-graphs --json "$LOGS/$2.json" ;;
    moe_copies) run "$2" 1 240 train --model 1b-moe "${flags[@]/--autocast/--bf16-copies}" --json "$LOGS/$2.json" ;;
    ds) run "$2" 1 300 train --model 1b-dsmoe "${flags[@]}" --json "$LOGS/$2.json" ;;
    ds_graphs) run "$2" 1 300 train --model 1b-dsmoe "${flags[@]}" --cuda-graphs --json "$LOGS/$2.json" ;;
    accum) run "$2" 1 240 train --model 1b-moe "${flags[@]}" --global-batch 8 --json "$LOGS/$2.json" ;;
    accum_graphs) run "$2" 1 240 train --model 1b-moe "${flags[@]}" --global-batch 8 --cuda-graphs \
                    --json "$LOGS/$2.json" ;;
    ds_dense) run "$2" 1 240 train --model 1b-dsmoe --model-config n_experts=0,d_ff=6840 "${flags[@]}" \
                --json "$LOGS/$2.json" ;;
  esac
}
orders=("moe graphs dense" "dense graphs moe" "graphs moe dense")
for r in $(seq 1 "$rounds"); do
  for which in ${orders[$(( (r - 1) % 3 ))]}; do
    side "$which" "${which}_$r"
    grep -q "throughput:" "$LOGS/${which}_$r.log" || { echo "${which}_$r failed: nothing else run"; exit 1; }
  done
done
if [[ ",$extra," == *,copies,* ]]; then side graphs_copies graphs_copies_1; fi
if [[ ",$extra," == *,copies2,* ]]; then side moe_copies moe_copies_1; fi
if [[ ",$extra," == *,dsmoe,* ]]; then side ds_graphs ds_graphs_1; side ds ds_1; side ds_dense ds_dense_1; fi
if [[ ",$extra," == *,accum,* ]]; then side accum_graphs accum_graphs_1; side accum accum_1; fi
profile() {  # name, playground args...
  local name=$1; shift
  timeout 240 torchrun --nproc_per_node 1 benchmarks/gpu_profile.py --out "$LOGS" --name "$name" --side playground \
    -- train "$@" "${flags[@]}" --backend torch --no-progress 2>&1 | grep -v "^W1" > "$LOGS/$name.log"
  echo "== $name: $(grep -i 'per step\|host:\|device:' "$LOGS/$name.txt" 2>/dev/null | head -3 | tr '\n' ' ')"
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
graphs_copies=(--model 1b-moe --bf16-copies --cuda-graphs)
dense_copies=(--model 1b-moe --model-config n_experts=0,d_ff=5472 --bf16-copies)
if [[ ",$extra," == *,deviceonly,* ]]; then  # copies graphed and not, the dense model, the autocast command
  for r in 1 2; do
    device_profile dev_graphs_copies_$r "${graphs_copies[@]}"
    device_profile dev_dense_copies_$r "${dense_copies[@]}"
  done
  device_profile dev_moe_copies_1 --model 1b-moe --bf16-copies
  device_profile dev_moe_autocast_1 --model 1b-moe
  device_profile dev_graphs_autocast_1 --model 1b-moe --cuda-graphs
fi
if [[ ",$extra," == *,gaps,* ]]; then  # the device's gaps: graphed copies, the dense model, graphed without the NaN check
  for r in 1 2; do
    device_profile gaps_graphs_copies_$r "${graphs_copies[@]}"
    device_profile gaps_dense_copies_$r "${dense_copies[@]}"
    device_profile gaps_graphs_nonan_$r "${graphs_copies[@]}" --on-nan off
  done
fi
[[ ",$extra," == *,noprofile,* ]] || profile profile_graphs --model 1b-moe --cuda-graphs
[[ ",$extra," == *,noprofile,* || ",$extra," == *,noprofile2,* ]] || profile profile_moe --model 1b-moe
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
