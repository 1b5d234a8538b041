"""Profile one side of a GPU comparison with the torch profiler, under torchrun:

    torchrun --nproc_per_node 2 benchmarks/gpu_profile.py --out DIR --side playground -- train --model 1b ...
    torchrun --nproc_per_node 2 benchmarks/gpu_profile.py --out DIR --side torch -- --mode ddp --model 1b ...

Runs `playground ARGS` (the command line) or benchmarks/gpu_side_by_side.py with ARGS under
`torch.profiler.profile` (CPU and CUDA activities) and writes, from rank 0, DIR/NAME.txt:
the ops by total CUDA time and by CPU time (top 25 each), and the device's busy time
(kernels and copies, summed) against the wall time of the profiled run.
"""
import argparse
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--side", choices=["playground", "torch"], required=True)
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if a.side == "playground":
        from playground.cli import main as target
        sys.argv = ["playground"] + args
    else:
        from benchmarks.gpu_side_by_side import main as target
        sys.argv = ["gpu_side_by_side.py"] + args
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        try:
            target()
        except SystemExit:
            pass
    wall = time.perf_counter() - t0
    if int(os.environ.get("RANK", "0")) != 0:
        return
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.txt"), "w") as f:
        f.write(f"{a.side}: {' '.join(args)}\n")
        f.write(f"wall {wall:.2f} s, device busy (kernels + copies, summed) {device_us / 1e6:.2f} s\n\n")
        f.write(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        f.write("\n\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
