"""Benchmark: activation checkpointing measured on GPUs beside the plan's prediction. Reads
the playground runs of benchmarks/ac_gpu.sh (the 1b preset, bf16, DDP on 2× H200, --ac
none / selective / full at growing micro-batches; committed in
benchmarks/results/gpu/run6_ac) and plans each on the `h200` profile here. Prints per run:
measured tokens/s and CUDA peak (or the out-of-memory that ended it), planned tokens/s and
peak, and the planned activations.

The two memories differ by construction: `train --dtype bfloat16` with DDP keeps fp32
weights and runs under autocast (its residual stream is fp32, and autocast caches a bf16
copy of each weight), while a plan prices bf16 compute copies with fp32 master weights;
the planned column says what mixed precision as Megatron runs it would take. Writes JSON.
"""
import argparse
import glob
import json
import os
import re
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402

MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu", "run6_ac")
RUN = re.compile(r"pg_ddp_(none|selective|full)_b(\d+)\.log$")


def row(log: str, hardware: str) -> dict:
    ac, mbs = RUN.search(log).groups()
    mbs = int(mbs)
    path = log[:-4] + ".json"
    measured = None
    if os.path.exists(path):
        m = json.load(open(path))
        measured = {"tokens_per_s": m["throughput"]["tokens_per_s"], "step_s": median(m["throughput"]["step_times_s"][1:]),
                    "cuda_peak_allocated": max(r["cuda_peak_allocated"] for r in m["memory"])}
    p = plan(RunConfig(model=preset("1b"), layout=Layout(dp=2, micro_batch_size=mbs, ac=ac), dtype="bfloat16",
                       hardware=hardware, progress=False))
    mem = max((v["memory"] for v in p.values), key=lambda v: v["peak_total"])
    return {"ac": ac, "micro_batch_size": mbs, "measured": measured,
            "out_of_memory": measured is None and "OutOfMemoryError" in open(log).read(),
            "planned": {"tokens_per_s": p.tokens_per_s, "step_s": p.step_s, "peak_total": mem["peak_total"],
                        "peak_activations": mem["peak_activations"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", default=MEASURED)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--json", default=default_json("ac_gpu"))
    a = ap.parse_args()
    logs = sorted((f for f in glob.glob(os.path.join(a.measured, "pg_ddp_*.log")) if RUN.search(f)),
                  key=lambda f: (("none", "selective", "full").index(RUN.search(f).group(1)), int(RUN.search(f).group(2))))
    rows = [row(f, a.hardware) for f in logs]
    gib = 2 ** 30
    print_table(f"1b, bf16, DDP on 2 GPUs: activation checkpointing measured, and planned on {a.hardware}",
                ["ac", "micro-batch", "measured tokens/s", "CUDA peak", "planned tokens/s", "planned/measured",
                 "planned peak", "planned activations"],
                [[r["ac"], r["micro_batch_size"],
                  f"{r['measured']['tokens_per_s']:,.0f}" if r["measured"] else "out of memory" if r["out_of_memory"] else "failed",
                  f"{r['measured']['cuda_peak_allocated'] / gib:.1f} GiB" if r["measured"] else "-",
                  f"{r['planned']['tokens_per_s']:,.0f}",
                  f"{r['planned']['tokens_per_s'] / r['measured']['tokens_per_s']:.2f}" if r["measured"] else "-",
                  f"{r['planned']['peak_total'] / gib:.1f} GiB", f"{r['planned']['peak_activations'] / gib:.1f} GiB"]
                 for r in rows])
    write_json(a.json, {"benchmark": "ac_gpu", "measured_from": os.path.relpath(a.measured), "rows": rows})


if __name__ == "__main__":
    main()
