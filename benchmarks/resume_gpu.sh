#!/usr/bin/env bash
# Resuming after a skipped step on one GPU (the torch backend: torch's fused AdamW, ZeRO's one
# pass, the fp16 loss scaler, the MoE balancing bias, on the device). Each case trains to step 6
# with a NaN injected at step 2 and skipped (--on-nan skip), uninterrupted; then to step 3,
# saved, and resumed to step 6 (--steps is the run's total). benchmarks/resume_compare.py
# compares the two checkpoints at step 6 (every piece's bytes, AdamW's step count) and the
# losses of steps 4-6. The first case runs uninterrupted twice (the control: a kernel that is
# not deterministic from run to run would make them differ) and resumes its step-3 checkpoint
# also on an earlier tree, DIR (`git archive COMMIT | tar -x -C DIR`), as it was before the
# checkpoint kept AdamW's own count.
#     bash benchmarks/resume_gpu.sh DIR
set -uo pipefail
old=$(cd "$1" && pwd)
source benchmarks/gpu_common.sh
CK=/tmp/resume_ckpts; mkdir -p "$CK"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$LOGS/gpus.txt"
compare() {  # name, whole checkpoint, resumed checkpoint, whole JSON, resumed JSON
  local name=$1; shift
  python benchmarks/resume_compare.py "$1" "$2" --losses "$3" "$4" 2>&1 | sed "s|$CK/||g" | tee "$LOGS/$name.compare"
}
case_() {  # name, control (yes/no), playground train args...
  local name=$1 control=$2; shift 2
  local fault=(--on-nan skip --inject nan@2:0)
  run "${name}_whole" 1 240 train "$@" --steps 6 "${fault[@]}" --save "$CK/${name}_whole" --json "$LOGS/${name}_whole.json"
  run "${name}_part" 1 240 train "$@" --steps 3 "${fault[@]}" --save "$CK/${name}_resumed"
  [ "$control" = yes ] && cp -r "$CK/${name}_resumed" "$CK/${name}_old"
  run "${name}_resumed" 1 240 train "$@" --steps 6 --resume "$CK/${name}_resumed" --save "$CK/${name}_resumed" \
    --json "$LOGS/${name}_resumed.json"
  compare "${name}" "$CK/${name}_whole" "$CK/${name}_resumed" "$LOGS/${name}_whole.json" "$LOGS/${name}_resumed.json"
  if [ "$control" = yes ]; then
    run "${name}_whole_2" 1 240 train "$@" --steps 6 "${fault[@]}" --save "$CK/${name}_whole_2" --json "$LOGS/${name}_whole_2.json"
    compare "${name}_control" "$CK/${name}_whole" "$CK/${name}_whole_2" "$LOGS/${name}_whole.json" "$LOGS/${name}_whole_2.json"
    (cd "$old" && export PYTHONPATH="$old" && run "${name}_resumed_old" 1 240 train "$@" --steps 6 \
      --resume "$CK/${name}_old" --save "$CK/${name}_old" --json "$LOGS/${name}_resumed_old.json")
    compare "${name}_old" "$CK/${name}_whole" "$CK/${name}_old" "$LOGS/${name}_whole.json" "$LOGS/${name}_resumed_old.json"
  fi
  tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
}
case_ copies yes --model small --dtype bfloat16 --bf16-copies
case_ zero3 yes --model small --dtype bfloat16 --zero 3
case_ moe no --model small-moe --dtype bfloat16 --bf16-copies
case_ fp16 no --model small --dtype float16 --zero 1
