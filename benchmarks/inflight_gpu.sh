#!/usr/bin/env bash
# Experiment (one GPU): the torch backend's run-ahead bound (DeviceTimes.max_in_flight, default 2)
# at 2, 8, 4 and 16 waited-but-unfinished calls, on 1b under ZeRO-3 at dp 1 (51 collectives a step,
# the step device-bound with the device idle 12.5 ms of 135 in its profile, run24_profile_zero3).
# The bound is set by patching the constructor's default in a wrapper of the command line (it is
# not an option of the command). Logs in $OUT/logs; committed as benchmarks/results/gpu/run25_inflight.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0; LOGS=$OUT/logs; mkdir -p $LOGS
for n in 2 8 4 16; do
  cat > /tmp/run_n.py <<PY
import sys
import collectives.torch_backend as t
t.DeviceTimes.__init__.__defaults__ = ($n,)
from playground.cli import main
sys.exit(main(sys.argv[1:]))
PY
  timeout 150 torchrun --nproc_per_node 1 /tmp/run_n.py train --model 1b --zero 3 --micro-batch-size 4 --dtype bfloat16 --steps 10 \
    --backend torch --no-progress --json $LOGS/1b_zero3-w1_inflight$n.json 2>&1 | grep -v "^W1" > $LOGS/1b_zero3-w1_inflight$n.log
  echo "== in flight $n: $(grep -E 'throughput|measured peak' $LOGS/1b_zero3-w1_inflight$n.log | tr '\n' ' ')"
done
