"""The host's time per eager op, measured two ways on one device (a GPU for what it says):
the tiny forward and backward `playground calibrate` times for `kernel_floor` (batch 1,
sequence 16, where every kernel is shorter than its launch), over a GPT of each model's
shapes at several depths. The wall time over the kernel count at one block is calibrate's
floor; the least-squares line through the depths splits it into a cost per op (the slope)
and a cost per step (the intercept: the loss, the backward's start, the embedding and the
head, spread over few ops at one block). A deep model's step is mostly the slope.

    python benchmarks/host_floor_gpu.py --json host_floor.json [--models 350m,1b] [--depths 1,2,4,8]

`--profiler-effect` times 350m's one-block and 12-block steps before and after a torch
profiler session (CPU and CUDA activities) in the same process, as `playground calibrate`
profiles its block just before it times the tiny step.
"""
import argparse
import json
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from model import preset  # noqa: E402
from playground.calibrate import counted, measure_floor, one_layer_step, timed  # noqa: E402


def tiny_step(cfg, layers: int, device: str):
    """Calibrate's tiny forward and backward (batch 1, sequence 16, bf16) at `layers` blocks."""
    return one_layer_step(cfg.with_(seq_len=16), 1, device, layers=layers)


def profiler_effect(cfg, device: str) -> dict:
    """The tiny step's wall time at 1 and 12 blocks, before and after a profiler session."""
    from torch.profiler import ProfilerActivity, profile
    steps = {n: tiny_step(cfg, n, device) for n in (1, 12)}
    before = {n: timed(s, device, repeats=7) for n, s in steps.items()}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities):
        for _ in range(3):
            steps[1]()
    after = {n: timed(s, device, repeats=7) for n, s in steps.items()}
    for n in steps:
        print(f"350m tiny step at {n} blocks: {before[n] * 1e3:.2f} ms before a profiler session, "
              f"{after[n] * 1e3:.2f} ms after")
    return {"before_s": before, "after_s": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="350m,1b,1b-moe-dense")
    ap.add_argument("--depths", default="1,2,4,8,12,24")
    ap.add_argument("--vocab", type=int, default=0, help="override the vocabulary (a CPU's smoke run)")
    ap.add_argument("--profiler-effect", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "chain_of_adds_s": measure_floor(device), "models": {}}
    print(f"a chain of adds: {out['chain_of_adds_s'] * 1e6:.1f} µs an op")
    for name in a.models.split(","):
        cfg = preset("1b-moe", n_experts=0, d_ff=5472) if name == "1b-moe-dense" else preset(name)
        if a.vocab:
            cfg = cfg.with_(vocab_size=a.vocab)
        rows = []
        for layers in (int(d) for d in a.depths.split(",")):
            kernels = counted(tiny_step(cfg, layers, "meta")).kernels
            wall = timed(tiny_step(cfg, layers, device), device, repeats=7)
            rows.append({"layers": layers, "kernels": kernels, "wall_s": wall})
            print(f"{name:>13} {layers:3d} layers: {kernels:5d} kernels, {wall * 1e3:7.2f} ms, "
                  f"{wall / kernels * 1e6:6.1f} µs a kernel")
        k = np.array([r["kernels"] for r in rows], float)
        w = np.array([r["wall_s"] for r in rows], float)
        slope, intercept = np.polyfit(k, w, 1)
        out["models"][name] = {"rows": rows, "per_op_s": slope, "per_step_s": intercept}
        print(f"{name:>13}: {slope * 1e6:.1f} µs an op + {intercept * 1e3:.2f} ms a step "
              f"(one block: {rows[0]['wall_s'] / rows[0]['kernels'] * 1e6:.1f} µs a kernel)")
    if a.profiler_effect:
        out["profiler_effect"] = profiler_effect(preset("350m"), device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
