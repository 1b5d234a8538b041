#!/usr/bin/env bash
# The check and resume on one CUDA GPU (run through the device tool): the CUDA tests CI
# skips (attention dropout's masks from the device's generator, replayed by recomputation),
# `playground check --backend torch` in float64 on the dense and MoE tiny presets, and a run
# with attention dropout resumed from a checkpoint against the uninterrupted one (losses
# compared to the bit). Logs go to $OUT/gpu_logs.tgz; one verdict line each is printed.
set -u
source benchmarks/gpu_common.sh
python3 -m pytest -q -p no:cacheprovider tests/test_dropout.py -k cuda 2>&1 | tail -3 > "$LOGS/cuda_tests.log"
echo "== cuda tests: $(tail -1 "$LOGS/cuda_tests.log")"
run check_tiny 1 300 check --model tiny --dtype float64 --steps 3 --micro-batch-size 2
run check_tiny_moe 1 300 check --model tiny-moe --dtype float64 --steps 3 --micro-batch-size 2
DROP=(--model tiny --model-config attention=unfused,attention_dropout=0.1 --dtype float64 --micro-batch-size 2)
run whole 1 300 train "${DROP[@]}" --steps 4 --json "$LOGS/whole.json"
run part 1 300 train "${DROP[@]}" --steps 2 --save /tmp/ck_dropout
run resumed 1 300 train "${DROP[@]}" --steps 4 --resume /tmp/ck_dropout --json "$LOGS/resumed.json"
python3 - "$LOGS" <<'EOF' | tee "$LOGS/resume_verdict.log"
import json, sys
whole = json.load(open(f"{sys.argv[1]}/whole.json"))["loss"]["per_step"]
resumed = json.load(open(f"{sys.argv[1]}/resumed.json"))["loss"]["per_step"]
same = resumed == whole[2:]
print(f"== resume with dropout on CUDA: uninterrupted steps 3-4 {whole[2:]}, resumed {resumed}: "
      f"{'bitwise equal' if same else 'DIFFERENT'}")
EOF
tar czf "$OUT/gpu_logs.tgz" -C "$LOGS" .
