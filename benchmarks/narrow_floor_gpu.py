"""Is calibrate's kernel floor the host's, or the model's? On one H100 the narrow step
(playground/calibrate.py: `narrow`, `measure_program`) fitted 31.6 µs an op on 350m and 49.9
and 52.3 on 1b and 1b-moe in one call, and only 31.6 planned the host-bound steps right
(benchmarks/results/gpu/run79_device_fit_h100). This times the narrow step of each model
several times, alternated, in one process, so that a floor that follows the model and one
that follows the host's moment can be told apart; and, once per model, the narrow step under
torch's profiler: the host's self time by op, and the device's busy time beside the host's
(a device busier than the host would fill the launch queue, and its waits would read as host).

    torchrun --nproc_per_node 1 benchmarks/narrow_floor_gpu.py --json F [--models 350m 1b 1b-moe] [--rounds 3]
"""
import argparse
import json
import os
import statistics
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from collectives.launch import launch  # noqa: E402
from model.config import preset  # noqa: E402
from playground import calibrate as cal  # noqa: E402


def profiled(world, cfg, device):
    """The narrow step trained under torch's profiler: per op name its host self time a step,
    and the device's kernel time a step (all steps after the warm-up)."""
    from torch.profiler import ProfilerActivity, profile
    from playground.training import train_rank
    run = cal.program_run(cfg, world.size, "torch")
    steps = run.steps - cal.PROGRAM_WARMUP
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        out = train_rank(world, run)
    events = prof.key_averages()
    host = sorted(((e.key, e.self_cpu_time_total / run.steps, e.count / run.steps) for e in events),
                  key=lambda r: -r[1])
    device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    own = [t - b for t, b in zip(out["step_times"], out["host_blocked"])][cal.PROGRAM_WARMUP:]
    aten = [e for e in events if e.key.startswith("aten::")]
    return {"host_under_profiler_s": statistics.median(own),
            "aten_calls_per_step": sum(e.count for e in aten) / run.steps,
            "aten_self_s_per_step": sum(e.self_cpu_time_total for e in aten) / 1e6 / run.steps,
            "launches_per_step": sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                           "cudaLaunchKernelExC", "cuLaunchKernelEx"))
            / run.steps, "device_s_per_step": device_us / 1e6 / run.steps,
            "steps_profiled": run.steps, "timed_steps": steps,
            "top_host_ops": [{"op": k, "self_us_per_step": us, "calls_per_step": n} for k, us, n in host[:40]]}


def rank(world, models, rounds):
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    got = {m: {"rounds": []} for m in models}
    for r in range(rounds):
        for m in (models if r % 2 == 0 else models[::-1]):
            got[m]["rounds"].append(cal.measure_program(world, preset(m), "torch", device))
            p = got[m]["rounds"][-1]
            print(f"round {r} {m}: host {p['host_s'] * 1e3:.1f} ms, regions {p.get('region_host_s', 0) * 1e3:.1f} ms",
                  flush=True)
    for m in models:
        got[m]["profile"] = profiled(world, preset(m), device)
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--models", nargs="+", default=["350m", "1b", "1b-moe"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res = launch(rank, None, "torch", args=(args.models, args.rounds), timeout=900.0)
    got = res.values[0]
    if got is None:
        return
    for m in args.models:
        ops, region_ops, calls = cal.issued(cal.program_run(preset(m), 1, "sim"))
        got[m].update(ops=ops, region_ops=region_ops, calls=calls)
        counts = {"ops": ops, "region_ops": region_ops, "calls": calls}
        got[m]["eager_floor_us"] = [cal.program_floors({**p, **counts}, None)[0] * 1e6 for p in got[m]["rounds"]]
        prof = got[m]["profile"]
        print(f"{m}: ops {ops:.0f} + region ops {region_ops:.0f}; eager floor by round "
              f"{', '.join(f'{x:.1f}' for x in got[m]['eager_floor_us'])} µs; under the profiler host "
              f"{prof['host_under_profiler_s'] * 1e3:.1f} ms, device busy {prof['device_s_per_step'] * 1e3:.1f} ms a step; "
              f"aten calls {prof['aten_calls_per_step']:.0f} a step ({prof['aten_self_s_per_step'] * 1e3:.1f} ms self), "
              f"launches {prof['launches_per_step']:.0f}")
        for row in prof["top_host_ops"][:15]:
            print(f"    {row['op'][:60]:60s} {row['self_us_per_step']:9.0f} µs  {row['calls_per_step']:6.1f} calls")
    with open(args.json, "w") as f:
        json.dump(got, f, indent=1)


if __name__ == "__main__":
    main()
