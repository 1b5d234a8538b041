#!/usr/bin/env bash
# What a change moved on one machine: the playground of this tree beside the same command at
# an earlier tree (DIR: `git archive COMMIT | tar -x -C DIR`), with plain PyTorch's step on the
# same model and batch between them (benchmarks/gpu_side_by_side.py, one GPU), in one call.
# Arguments: DIR, then pairs MODEL:MBS[:ROUNDS[:FLAGS]] (default rounds 1; FLAGS: more
# `playground train` flags for both trees, comma-separated: --bf16-copies or --zero,3); each
# round runs the earlier tree, torch, this tree, and the next round the other way round. Files,
# as side_by_side.py reads them: torch_single_MODEL_bMBS[TAG][_R].json, pg_... (this tree),
# old_... (the earlier tree); TAG names the flags (_bf16-copies, _zero3). The torch side is
# one GPU under autocast whatever the flags: the same program in every round, so it also
# shows how the machine drifts.
set -uo pipefail
old=$(cd "$1" && pwd); shift
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$LOGS/gpus.txt"
side() {  # tree (new|old|torch), name, model, mbs, playground flags...
  local tree=$1 name=$2 m=$3 b=$4; shift 4
  if [ "$tree" = torch ]; then
    timeout 240 torchrun --nproc_per_node 1 benchmarks/gpu_side_by_side.py --steps 10 --mode single --model "$m" \
      --mbs "$b" --json "$LOGS/torch_$name.json" 2>&1 | grep -v "^W1" > "$LOGS/torch_$name.log"
    echo "== torch_$name: $(tail -1 "$LOGS/torch_$name.log" | cut -c1-200)"
    tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
  elif [ "$tree" = new ]; then
    run "pg_$name" 1 240 train --model "$m" --micro-batch-size "$b" --dtype bfloat16 --steps 10 --json "$LOGS/pg_$name.json" "$@"
  else
    (cd "$old" && export PYTHONPATH="$old" && run "old_$name" 1 240 train --model "$m" --micro-batch-size "$b" --dtype bfloat16 \
       --steps 10 --json "$LOGS/old_$name.json" "$@")
  fi
}
for pair in "$@"; do
  IFS=: read -r m b rounds flags <<< "$pair"
  IFS=, read -r -a extra <<< "${flags:-}"
  tag=$(printf '%s' "${flags:-}" | tr -d ',' | sed 's/^--/_/; s/--/_/g')
  for r in $(seq 1 "${rounds:-1}"); do
    name="single_${m}_b${b}${tag}$([ "$r" -gt 1 ] && echo "_$r")"
    if [ $((r % 2)) -eq 1 ]; then order="old torch new"; else order="new torch old"; fi
    for tree in $order; do side "$tree" "$name" "$m" "$b" "${extra[@]}"; done
  done
done
