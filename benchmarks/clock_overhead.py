"""Benchmark: the cost of simulating time and accounting memory (issue 4, item 7). The
8-rank DDP run of the first recipe (small GPT, micro-batch 8) with both off and on
(`--hardware h100-sxm`: every op goes through the per-rank compute model, every call
through the cost model, every tensor saved for backward through the memory tracker). Target: at most 1.2× slower with it on. Median step over alternating runs, each
in-process. Prints a table and writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import median, print_table, write_json  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.train import train  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "clock_overhead.json"))
    args = ap.parse_args()
    runs = {"off": [], "on": []}
    for _ in range(args.reps):
        for mode in ("off", "on"):
            res = train(RunConfig(model=preset("small"), layout=Layout(dp=8, micro_batch_size=8), steps=args.steps,
                                  progress=False, hardware="h100-sxm" if mode == "on" else None))
            runs[mode].append(median(res.step_times[1:]))
    off, on = median(runs["off"]), median(runs["on"])
    print_table("simulated time and memory accounting off vs on (8 ranks, small GPT, median step)", ["", "off", "on", "on / off", "target"],
                [["median step", f"{off * 1e3:.0f} ms", f"{on * 1e3:.0f} ms", f"{on / off:.2f}", "<= 1.2"]])
    print("per run (ms): off " + ", ".join(f"{x * 1e3:.0f}" for x in runs["off"]) +
          "; on " + ", ".join(f"{x * 1e3:.0f}" for x in runs["on"]))
    write_json(args.json, {"off_s": off, "on_s": on, "ratio": on / off, "runs": runs, "steps": args.steps})


if __name__ == "__main__":
    main()
