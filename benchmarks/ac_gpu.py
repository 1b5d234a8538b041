"""Benchmark: activation checkpointing measured on GPUs beside the plan's prediction. Reads
the playground runs of benchmarks/ac_gpu.sh and plans each on the `h200` profile here.

By default the one-GPU runs (`ac_gpu.sh single`: the 1b preset in bf16 with bf16 compute
copies and fp32 masters, the mixed precision a plan prices; --ac none / selective / full,
each at the largest micro-batch the plan fits, and at micro-batch 4), committed in
benchmarks/results/gpu/run27_one_gpu and run28_before_after (selective at 32, after 40 ran
out of memory). With `--measured .../run6_ac`: the earlier 2-GPU DDP runs under autocast
(fp32 weights, a bf16 copy of each cached by autocast: not what a plan prices, so their
memory is not compared, and they predate the model's fused kernels).

Prints per run: measured tokens/s, MFU and CUDA peak (or the out-of-memory that ended it),
planned tokens/s and peak, the step's and the peak's planned-over-measured error, and the
planned activations. Writes JSON.
"""
import argparse
import json
import os
import re
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402
from benchmarks.gpu_runs import read, step_times  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402
from simulator import load_hardware  # noqa: E402

GPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu")
MEASURED = [os.path.join(GPU, "run27_one_gpu"), os.path.join(GPU, "run28_before_after")]
# one GPU (ac_gpu.sh single) and 2-GPU DDP (run6_ac) run names
RUN = re.compile(r"(?:1b-ac(?P<ac>none|selective|full)-b(?P<mbs>\d+)_single|"
                 r"pg_ddp_(?P<ac2>none|selective|full)_b(?P<mbs2>\d+))\.log$")
MODES = ("none", "selective", "full")


def parse(log: str) -> tuple:
    """(ac, micro-batch, ranks) of a run's log name."""
    m = RUN.search(log)
    return (m["ac"], int(m["mbs"]), 1) if m["ac"] else (m["ac2"], int(m["mbs2"]), 2)


def row(log: str, files: dict, hardware: str) -> dict:
    """The run whose log is `log` (a name among its run's `files`: {name: text})."""
    ac, mbs, ranks = parse(log)
    path = log[:-4] + ".json"
    cfg = preset("1b")
    measured = None
    if path in files:
        m = json.loads(files[path])
        tokens = m["throughput"]["tokens_per_s"]
        measured = {"tokens_per_s": tokens, "step_s": median(step_times(m["throughput"])[1:]),
                    "mfu": cfg.mfu(tokens, ranks, load_hardware(hardware).peak_bf16_flops),
                    "cuda_peak_allocated": max(r["cuda_peak_allocated"] for r in m["memory"])}
    p = plan(RunConfig(model=cfg, layout=Layout(dp=ranks, micro_batch_size=mbs, ac=ac), dtype="bfloat16",
                       hardware=hardware, progress=False))
    mem = max((v["memory"] for v in p.values), key=lambda v: v["peak_total"])
    text = files[log]
    return {"ac": ac, "micro_batch_size": mbs, "ranks": ranks, "measured": measured,
            "out_of_memory": measured is None and ("OutOfMemoryError" in text or "'out of memory'" in text),
            "memory_compared": ranks == 1,  # (the 2-GPU runs ran under autocast: see the docstring)
            "planned": {"tokens_per_s": p.tokens_per_s, "step_s": p.step_s, "peak_total": mem["peak_total"],
                        "peak_activations": mem["peak_activations"]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", nargs="+", default=MEASURED)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--json", default=default_json("ac_gpu"))
    a = ap.parse_args()
    runs = [dict(read(d)) for d in a.measured]
    logs = sorted(((f, files) for files in runs for f in files if f.endswith(".log") and RUN.search(f)),
                  key=lambda x: (MODES.index(parse(x[0])[0]), parse(x[0])[1]))
    rows = [row(f, files, a.hardware) for f, files in logs]
    gib = 2 ** 30

    def error(planned, measured):
        return f"{planned / measured - 1:+.0%}"
    print_table(f"1b, bf16, activation checkpointing: measured on {rows[0]['ranks'] if rows else '?'} H200 and planned "
                f"on {a.hardware}",
                ["ac", "micro-batch", "measured tokens/s", "MFU", "CUDA peak", "planned tokens/s", "step error",
                 "planned peak", "peak error", "planned activations"],
                [[r["ac"], r["micro_batch_size"],
                  f"{r['measured']['tokens_per_s']:,.0f}" if r["measured"] else "out of memory" if r["out_of_memory"] else "failed",
                  f"{r['measured']['mfu']:.1%}" if r["measured"] else "-",
                  f"{r['measured']['cuda_peak_allocated'] / gib:.2f} GiB" if r["measured"] else "-",
                  f"{r['planned']['tokens_per_s']:,.0f}",
                  error(r["planned"]["step_s"], r["measured"]["step_s"]) if r["measured"] else "-",
                  f"{r['planned']['peak_total'] / gib:.2f} GiB",
                  error(r["planned"]["peak_total"], r["measured"]["cuda_peak_allocated"])
                  if r["measured"] and r["memory_compared"] else "-",
                  f"{r['planned']['peak_activations'] / gib:.2f} GiB"]
                 for r in rows])
    write_json(a.json, {"benchmark": "ac_gpu", "measured_from": [os.path.relpath(d) for d in a.measured], "rows": rows})


if __name__ == "__main__":
    main()
