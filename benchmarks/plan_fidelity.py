"""Benchmark: how close `playground plan` comes to measured GPU steps. For each train JSON
that benchmarks/plan_fidelity_gpu.sh wrote (the 350m preset in bf16 under torchrun on
2× H200; the committed run is benchmarks/results/gpu/run5_plan_fidelity), plans the same
model and layout on the `h200` profile here and prints, per layout: the measured median step
(steps after the first), the planned step, planned/measured, and the planned step's split
into compute, exposed communication and idle. Writes JSON.

Memory is printed but not compared as a prediction: `train --backend torch --dtype
bfloat16` keeps fp32 weights under autocast, while a plan prices bf16 weights with fp32
master weights and moments (mixed-precision training as Megatron runs it), and CUDA's peak
also holds the caching allocator's and the kernels' workspaces.
"""
import argparse
import glob
import json
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402
from collectives.ledger import human_bytes  # noqa: E402
from model import GPTConfig  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402

MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu", "run5_plan_fidelity")


def compare(path: str, hardware: str) -> dict:
    m = json.load(open(path))
    model = GPTConfig(**{k: v for k, v in m["model"].items() if k != "n_params"})
    layout = Layout(**{k: v for k, v in m["layout"].items() if k not in ("world", "global_batch")})
    measured = median(m["throughput"]["step_times_s"][1:])
    p = plan(RunConfig(model=model, layout=layout, dtype=m["run"]["dtype"], hardware=hardware, progress=False))
    slowest = max(p.values, key=lambda v: v["step"]["time"])["step"]
    return {"layout": os.path.basename(path)[:-5], "describe": layout.describe(), "measured_step_s": measured,
            "planned_step_s": p.step_s, "ratio": p.step_s / measured, "planned": slowest,
            "measured_cuda_peak": max(r.get("cuda_peak_allocated", 0) for r in m["memory"]),
            "planned_peak": max(v["memory"]["peak_total"] for v in p.values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", default=MEASURED, help="the folder of train JSONs from plan_fidelity_gpu.sh")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--json", default=default_json("plan_fidelity"))
    a = ap.parse_args()
    rows = [compare(f, a.hardware) for f in sorted(glob.glob(os.path.join(a.measured, "*.json")))]
    if not rows:
        sys.exit(f"plan_fidelity: no train JSON in {a.measured}")
    print_table(f"350m, bf16, 2 GPUs: planned on {a.hardware} against measured (median step)",
                ["layout", "measured", "planned", "planned/measured", "compute", "exposed comm", "idle",
                 "CUDA peak", "planned peak"],
                [[r["layout"], f"{r['measured_step_s'] * 1e3:.1f} ms", f"{r['planned_step_s'] * 1e3:.1f} ms",
                  f"{r['ratio']:.2f}", f"{r['planned']['compute'] * 1e3:.1f} ms",
                  f"{r['planned']['exposed_comm'] * 1e3:.1f} ms", f"{r['planned']['idle'] * 1e3:.1f} ms",
                  human_bytes(r["measured_cuda_peak"]), human_bytes(r["planned_peak"])] for r in rows])
    write_json(a.json, {"benchmark": "plan_fidelity", "measured_from": os.path.relpath(a.measured), "rows": rows})


if __name__ == "__main__":
    main()
