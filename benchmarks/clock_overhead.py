"""Benchmark: the cost of simulating time and accounting memory. The
8-rank DDP run of the first recipe (small GPT, micro-batch 8) three ways: off; on
(`--hardware h100-datasheet`: step 0 counted op by op, step 1 recorded, later steps replay
its compute with op counting off, see simulator/clock.py); and on with every step
counted op by op (`--count-every-step`). Target: at most 1.2× slower with it on.

Reported per mode: the median step over steps 2.. (the steady state) and the whole run
(every step, the counted and recorded ones included). Alternating runs, each in-process;
the medians over runs are quoted. Prints a table and writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.training import train  # noqa: E402

MODES = {"off": {}, "on": {"hardware": "h100-datasheet"},
         "on, every step counted": {"hardware": "h100-datasheet", "count_every_step": True}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=default_json("clock_overhead"))
    args = ap.parse_args()
    steady = {m: [] for m in MODES}
    whole = {m: [] for m in MODES}
    for _ in range(args.reps):
        for mode, extra in MODES.items():
            res = train(RunConfig(model=preset("small"), layout=Layout(dp=8, micro_batch_size=8), steps=args.steps,
                                  progress=False, **extra))
            steady[mode].append(median(res.step_times[2:]))
            whole[mode].append(sum(res.step_times))
    off_s, off_w = median(steady["off"]), median(whole["off"])
    rows = []
    for mode in MODES:
        s, w = median(steady[mode]), median(whole[mode])
        rows.append([mode, f"{s * 1e3:.0f} ms", f"{s / off_s:.2f}", f"{w:.1f} s", f"{w / off_w:.2f}",
                     "<= 1.2" if mode == "on" else "-"])
    print_table(f"simulated time and memory accounting (8 ranks, small GPT, micro-batch 8, {args.steps} steps)",
                ["", "median step (2..)", "/ off", "whole run", "/ off", "target"], rows)
    for mode in MODES:
        print(f"per run, {mode}: median step (ms) " + ", ".join(f"{x * 1e3:.0f}" for x in steady[mode]) +
              "; whole run (s) " + ", ".join(f"{x:.1f}" for x in whole[mode]))
    write_json(args.json, {"steps": args.steps, "steady_s": steady, "whole_s": whole,
                           "ratio_steady": median(steady["on"]) / off_s, "ratio_whole": median(whole["on"]) / off_w})


if __name__ == "__main__":
    main()
