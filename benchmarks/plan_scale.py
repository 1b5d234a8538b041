"""Benchmark: planning at scale. `playground plan` of the 70b preset (80 layers, d_model
8192, 64 heads with 8 key/value heads, d_ff 28672, vocabulary 128256, 4096 tokens) on 1024
ranks of h100-sxm: tp 8 × pp 16 × dp 8, sequence parallel, ZeRO-1, interleaved 1F1B with 5
chunks per rank, 16 microbatches of 1 sequence; by stand-ins, one rank per pipeline stage
(README, "Planning at scale"). Prints the wall time and the peak resident memory of the
planning (targets: ≤ 60 s, ≤ 2 GiB on 2 cores) beside the plan's step, tokens/s, MFU and peak
memory per GPU. Writes JSON.
"""
import argparse
import os
import resource
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from collectives.ledger import human_bytes  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=default_json("plan_scale"))
    a = ap.parse_args()
    layout = Layout(tp=8, pp=16, dp=8, zero=1, sequence_parallel=True, schedule="interleaved", virtual_stages=5,
                    microbatches=16, micro_batch_size=1)
    run = RunConfig(model=preset("70b"), layout=layout, dtype="bfloat16", hardware="h100-sxm", progress=False)
    t0 = time.perf_counter()
    p = plan(run)
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    peak = p.peak
    row = {"world": layout.world, "describe": layout.describe(), "wall_s": wall, "max_rss": rss,
           "by_classes": p.by_classes, "step_s": p.step_s, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu,
           "peak_per_gpu": peak}
    print_table("70b on 1024 ranks of h100-sxm, planned by stand-ins", ["ranks", "planned in", "max RSS", "step",
                "tokens/s", "MFU", "peak per GPU"],
                [[layout.world, f"{wall:.1f} s", human_bytes(rss), f"{p.step_s * 1e3:.1f} ms",
                  f"{p.tokens_per_s:,.0f}", f"{100 * p.mfu:.1f}%", human_bytes(peak)]])
    write_json(a.json, {"benchmark": "plan_scale", "rows": [row]})


if __name__ == "__main__":
    main()
