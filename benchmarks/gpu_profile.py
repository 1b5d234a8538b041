"""Profile one side of a GPU comparison with the torch profiler, under torchrun:

    torchrun --nproc_per_node 2 benchmarks/gpu_profile.py --out DIR --side playground -- train --model 1b ...
    torchrun --nproc_per_node 2 benchmarks/gpu_profile.py --out DIR --side torch -- --mode ddp --model 1b ...

Runs `playground ARGS` (the command line) or benchmarks/gpu_side_by_side.py with ARGS under
`torch.profiler.profile` (CPU and CUDA activities) and writes, from rank 0, DIR/NAME.txt:
the steady state (below), the ops by total CUDA time and by CPU time (top 25 each), and
the device's busy time (kernels and copies, summed) against the wall time of the run.

The steady state: the last `--last` whole steps before the final one (both sides mark
each step with a "train.step" range), from one step's start on the host to the start of
the step `--last` later. Over that window, per step: the device's busy time (the union
of its kernels on every stream), of which NCCL kernels and compute alone, the device's
idle time, the kernels launched and the host's time blocked in CUDA synchronisation.
A device idle while the host never blocks is a host-bound step: the host's time per
launch (the window over the launches) is then the step's cost per kernel.

`--device-only` records the device alone (CUPTI's kernels and copies, no host op: the full
profiler costs the host tens of µs a launch, so it makes any step host-bound): over `--last`
steps after `--skip` + 1, the device's period, busy and idle time per step, where it idles
(`device_gaps`) and which kernels take its time (`device_busy`).
"""
import argparse
import os
import re
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def union(intervals: list) -> float:
    """The length covered by [(start, end)] intervals."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def clip(intervals: list, lo: float, hi: float) -> list:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemcpyAsync",
            "cudaMemsetAsync", "cudaLaunchCooperativeKernel")


def classify(kineto_events) -> tuple:
    """(steps, launch_at, device, ops) of the profiler's kineto events (times in ns on one
    clock): the host's "train.step" starts, sorted; each launch's host time by correlation
    id; the device's events (start, end, name, correlation id); and the host's other ops
    (start, end, name)."""
    steps, launch_at, device, ops = [], {}, [], []
    for e in kineto_events:
        start, end = e.start_ns(), e.start_ns() + e.duration_ns()
        if e.device_type().name == "CPU":
            if e.name() == "train.step":
                steps.append(start)
            elif e.name() in LAUNCHES:
                launch_at[e.correlation_id()] = start
            else:
                ops.append((start, end, e.name()))
        elif not getattr(e, "is_user_annotation", lambda: False)():
            device.append((start, end, e.name(), e.correlation_id()))
    return sorted(steps), launch_at, device, ops


def steady_state(kineto_events, last: int) -> str:
    """The steady-state lines (module docstring) from the profiler's kineto events (times in
    ns on one clock). The device's window starts at the first device event launched in a
    step (matched to its launch by correlation id): the host may run ahead of the device."""
    host, launch_at, device, _ = classify(kineto_events)
    if len(host) < last + 2:
        return f"steady state: {len(host)} train.step ranges, need {last + 2}"
    h0, h1 = host[-last - 2], host[-2]
    blocked = union(clip([(e.start_ns(), e.start_ns() + e.duration_ns()) for e in kineto_events
                          if e.device_type().name == "CPU" and "Synchronize" in e.name()], h0, h1))
    launches = sum(h0 <= t < h1 for t in launch_at.values())

    def first_launched_after(t):
        starts = [d[0] for d in device if launch_at.get(d[3], -1) >= t]
        return min(starts) if starts else None
    d0, d1 = first_launched_after(h0), first_launched_after(h1)
    if d0 is None or d1 is None:
        return f"steady state: no device events launched in the window ({len(device)} device events)"
    nccl = [(a, b) for a, b, n, _ in device if "nccl" in n.lower()]
    compute = [(a, b) for a, b, n, _ in device if "nccl" not in n.lower()]
    busy = union(clip(nccl + compute, d0, d1))
    busy_compute, busy_nccl = union(clip(compute, d0, d1)), union(clip(nccl, d0, d1))
    durations = sorted(b - a for a, b in nccl if d0 <= a < d1)
    n = len(durations)
    median = durations[n // 2] / 1e3 if n else 0.0
    p90 = durations[min(n - 1, int(n * 0.9))] / 1e3 if n else 0.0
    ms = lambda ns: ns / last / 1e6  # noqa: E731  (per step)
    period, host_period = ms(d1 - d0), ms(h1 - h0)
    return "\n".join([
        f"steady state over {last} steps ({len(host)} marked): per step",
        f"  device: period {period:.2f} ms, busy {ms(busy):.2f} ms: compute kernels {ms(busy_compute):.2f} ms, "
        f"NCCL {ms(busy_nccl):.2f} ms ({n / last:.0f} kernels, median {median:.0f} µs, p90 {p90:.0f} µs), "
        f"NCCL alone {ms(busy - busy_compute):.2f} ms; idle {period - ms(busy):.2f} ms",
        f"  host: period {host_period:.2f} ms, blocked in CUDA synchronisation {ms(blocked):.2f} ms, "
        f"{launches / last:.0f} launches ({1e3 * (host_period - ms(blocked)) / max(1, launches / last):.1f} µs of "
        f"unblocked host per launch)"])


def idle_gaps(kineto_events, last: int, top: int = 25) -> str:
    """Where the device waits for the host in the steady state (`steady_state`'s window): each
    gap of over 5 µs between the device's kernels is charged to the host op that launched the
    kernel ending it (the device waited for that launch), innermost and outermost op apart,
    summed per step, largest first."""
    import bisect
    steps, launch_at, device, ops = classify(kineto_events)
    device = [(start, end, corr) for start, end, _, corr in device]
    if len(steps) < last + 2:
        return "idle gaps: too few steps"
    h0, h1 = steps[-last - 2], steps[-2]
    ops.sort()
    starts = [o[0] for o in ops]
    device = sorted(d for d in device if h0 <= launch_at.get(d[2], -1) < h1)
    inner: dict = {}
    outer: dict = {}
    reach = None
    for start, end, corr in device:
        t = launch_at[corr]
        if reach is not None and start - reach > 5000 and t < reach:  # launched before: waited for something else
            gap = (start - reach) / last / 1e6
            inner["(launched before the gap)"] = inner.get("(launched before the gap)", 0.0) + gap
        elif reach is not None and start - reach > 5000:
            around = [o for o in ops[max(0, bisect.bisect_right(starts, t) - 4000):bisect.bisect_right(starts, t)]
                      if o[1] >= t and o[2] != "train.step"]
            gap = (start - reach) / last / 1e6
            if around:
                i, o = min(around, key=lambda o: o[1] - o[0]), max(around, key=lambda o: o[1] - o[0])
                inner[i[2]] = inner.get(i[2], 0.0) + gap
                outer[o[2]] = outer.get(o[2], 0.0) + gap
            else:
                inner["(no op)"] = inner.get("(no op)", 0.0) + gap
        reach = end if reach is None else max(reach, end)
    lines = [f"device idle per step (gaps over 5 µs), by the host op launching the kernel after the gap:"]
    for title, table in (("innermost op", inner), ("outermost op", outer)):
        lines.append(f"  {title}: {sum(table.values()):.2f} ms")
        for name, ms in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {ms:8.3f} ms  {name[:110]}")
    return "\n".join(lines)


def python_profile(a, target, args) -> None:
    """`--python`: the run under cProfile; from rank 0, NAME.txt (see the option's help)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        target()
    except SystemExit:
        pass
    prof.disable()
    wall = time.perf_counter() - t0
    if int(os.environ.get("RANK", "0")) != 0:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.txt"), "w") as f:
        f.write(f"python profile of playground {' '.join(args)}: wall {wall:.2f} s\n\n")
        for title, key, limit, restrict in (("by own time", "tottime", 60, ()),
                                            ("this repository's, by cumulative time", "cumulative", 80, (root,))):
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text).sort_stats(key)
            stats.print_stats(*[r.replace("\\", "/") for r in restrict], limit)
            f.write(f"== {title}\n{text.getvalue()}\n")


def device_profile(a, target, args) -> None:
    """`--device-only`: CUPTI's record of the device alone (no host op is recorded, so the host
    runs as it does unprofiled: the full profiler costs it tens of µs a launch), over `--last`
    steps after `--skip`, cut at the optimizer steps; from rank 0, NAME.txt: per step, the
    device's period (its first kernel to its last over the window), its busy time (the union
    of its kernels and copies on every stream) and its idle time, and the kernels launched.
    The host's own time per step is the train JSON's (step_times less host_blocked)."""
    from torch.profiler import schedule
    import playground.rank_program as rank_program
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # (a CPU: no device)
    device = []

    def record(p):  # the window's events, when it closes
        device.extend((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in p.profiler.kineto_results.events()
                      if e.device_type().name != "CPU" or activity == ProfilerActivity.CPU)
    with profile(activities=[activity], schedule=schedule(wait=a.skip, warmup=1, active=a.last, repeat=1),
                 on_trace_ready=record) as prof:
        update = rank_program.RankProgram.update

        def update_and_mark(self, *args):
            update(self, *args)
            prof.step()
        rank_program.RankProgram.update = update_and_mark
        try:
            target()
        except SystemExit:
            pass
        finally:
            rank_program.RankProgram.update = update
    if int(os.environ.get("RANK", "0")) != 0:
        return
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.txt"), "w") as f:
        f.write(f"{a.side}: {' '.join(args)}\n")
        if not device:
            f.write("device only: no device events recorded\n")
            return
        d0, d1 = min(d[0] for d in device), max(d[1] for d in device)
        busy = union([(s, e) for s, e, _ in device])
        ms = lambda ns: ns / a.last / 1e6  # noqa: E731  (per step)
        f.write(f"device only, {a.last} steps after {a.skip + 1}: per step: device period {ms(d1 - d0):.2f} ms, "
                f"busy {ms(busy):.2f} ms, idle {ms(d1 - d0 - busy):.2f} ms, {len(device) / a.last:.0f} kernels "
                f"and copies\n\n")
        f.write(device_gaps(device, a.last) + "\n\n")
        f.write(device_busy(device, a.last) + "\n")


def kernel(name: str) -> str:
    """A kernel's name short enough to read: its function without templates and arguments."""
    if name.startswith(("Memcpy", "Memset")):
        return name
    what = re.search(r"\w+_kernel_cuda|CUDAFunctor\w*|\w+Functor\b", name) if "elementwise" in name else None
    if what:  # torch's elementwise kernels: the op is in the template's functor or lambda
        return f"{kernel(name.split('<')[0])}: {what.group(0)}"
    name = re.sub(r"^std::enable_if<.*?>::type\s+", "", name)  # a return type, not the kernel
    name = name.replace("(anonymous namespace)", "anon").split("(")[0]
    while "<" in name:  # innermost template arguments first
        cut = max(name.rfind("<", 0, name.find(">")) if ">" in name else -1, 0)
        end = name.find(">", cut)
        name = name[:cut] + name[end + 1:] if end > cut else name[:cut]
    return name.replace("void ", "").strip()[:80]


def device_busy(device: list, last: int, top: int = 30) -> str:
    """Where the device's time goes, from its events alone ((start, end, name), ns): each
    kernel's (or copy's) time summed per step by its short name, with its count a step."""
    by_kernel: dict = {}
    for start, end, name in device:
        k = kernel(name)
        by_kernel[k] = by_kernel.get(k, [0, 0.0])
        by_kernel[k][0] += 1
        by_kernel[k][1] += end - start
    lines = ["device time per step by kernel (calls a step, ms a step):"]
    lines += [f"    {n / last:6.1f} {ns / last / 1e6:8.3f} ms  {k}" for k, (n, ns) in
              sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]]
    return "\n".join(lines)


def device_gaps(device: list, last: int, top: int = 25) -> str:
    """Where the device idles, from its events alone ((start, end, name), ns): each gap of over
    5 µs between the end of everything run so far and the next event's start, summed per step
    by the kernel that ends it (the one the device waited for) and by the pair around it;
    their sizes (many short gaps: a stretch of kernels shorter than their launches; a few
    long ones: the host stopped, at a synchronisation or in work of its own); and their place
    in the step (the window cut into `last` periods of equal length, each into tenths)."""
    device = sorted(device)
    d0, d1 = device[0][0], max(e for _, e, _ in device)
    period = (d1 - d0) / last
    by_after: dict = {}
    by_pair: dict = {}
    sizes = {"5-20 µs": [0, 0.0], "20-100 µs": [0, 0.0], "0.1-1 ms": [0, 0.0], "over 1 ms": [0, 0.0]}
    tenths = [0.0] * 10
    reach, before = None, None
    for start, end, name in device:
        if reach is not None and start - reach > 5000:
            gap = start - reach
            after = kernel(name)
            by_after[after] = by_after.get(after, [0, 0.0])
            by_after[after][0] += 1
            by_after[after][1] += gap
            pair = f"{before} -> {after}"
            by_pair[pair] = by_pair.get(pair, [0, 0.0])
            by_pair[pair][0] += 1
            by_pair[pair][1] += gap
            key = "5-20 µs" if gap < 20e3 else "20-100 µs" if gap < 100e3 else "0.1-1 ms" if gap < 1e6 else "over 1 ms"
            sizes[key][0] += 1
            sizes[key][1] += gap
            tenths[min(9, int(10 * ((reach - d0) % period) / period))] += gap
        if reach is None or end > reach:
            reach, before = end, kernel(name)
    per = lambda ns: ns / last / 1e6  # noqa: E731  (ms per step)
    lines = [f"device idle per step in gaps over 5 µs: {per(sum(v[1] for v in sizes.values())):.2f} ms",
             "  by size: " + ", ".join(f"{k}: {v[0] / last:.1f} gaps, {per(v[1]):.2f} ms" for k, v in sizes.items()),
             "  by tenth of the step: " + " ".join(f"{per(t):.2f}" for t in tenths) + " ms",
             "  by the kernel ending the gap (gaps a step, ms a step):"]
    lines += [f"    {n / last:6.1f} {per(ns):8.3f} ms  {k}" for k, (n, ns) in
              sorted(by_after.items(), key=lambda kv: -kv[1][1])[:top]]
    lines.append("  by the kernels before and after the gap:")
    lines += [f"    {n / last:6.1f} {per(ns):8.3f} ms  {k[:150]}" for k, (n, ns) in
              sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:top]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--side", choices=["playground", "torch"], required=True)
    ap.add_argument("--last", type=int, default=3, help="steps in the steady-state window")
    ap.add_argument("--python", action="store_true",
                    help="profile the host's Python instead (cProfile over the whole run: where the host's time "
                         "per step goes when the step is host-bound); writes NAME.txt with the functions by own "
                         "time and this repository's by cumulative time")
    ap.add_argument("--device-only", action="store_true",
                    help="record the device alone (CUPTI, no host ops: the host runs at its unprofiled speed), over "
                         "--last steps after --skip; writes NAME.txt with the device's period, busy and idle time")
    ap.add_argument("--skip", type=int, default=4, help="with --device-only: steps before the window, less one")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if a.side == "playground":
        from playground.cli import main as target
        sys.argv = ["playground"] + args
    else:
        from benchmarks.gpu_side_by_side import main as target
        sys.argv = ["gpu_side_by_side.py"] + args
    if a.python:
        return python_profile(a, target, args)
    if a.device_only:
        return device_profile(a, target, args)
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
        f.write(steady_state(prof.profiler.kineto_results.events(), a.last) + "\n\n")
        f.write(idle_gaps(prof.profiler.kineto_results.events(), a.last) + "\n\n")
        f.write(events.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        f.write("\n\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
