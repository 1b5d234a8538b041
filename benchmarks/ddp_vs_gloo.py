"""Benchmark: our DDP on simulated ranks against torch's own DistributedDataParallel on
gloo processes.

GPT with vocab 256, d_model 128, 4 layers, 4 heads, sequence 128 (the `small` preset),
micro-batch 8 sequences per rank, 8 ranks, 20 steps, float32, same data on both.
Reported: median step time (rank 0), end-to-end time (from the launch to the results),
peak memory (max RSS of the process; for gloo the sum over the rank processes and the
parent), their ratios, and the largest world size each completes on this machine.
Targets: end to end at most 0.5 of gloo, median step at most 1.0 of gloo, 256 simulated
ranks complete. Each configuration runs in a fresh subprocess.

    python benchmarks/ddp_vs_gloo.py [--steps 20] [--world 8] [--no-scaling]
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402

MICRO_BATCH = 8


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _meminfo(key="MemAvailable") -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


# -- the simulated run ----------------------------------------------------------------------
def one_sim(world: int, steps: int) -> dict:
    from model import preset
    from playground import Layout, RunConfig
    from playground.training import train
    t0 = time.perf_counter()
    res = train(RunConfig(model=preset("small"), layout=Layout(dp=world, micro_batch_size=MICRO_BATCH),
                          steps=steps, progress=False))
    return {"end_to_end_s": time.perf_counter() - t0, "step_s": res.step_times, "loss": res.losses,
            "peak_rss_bytes": _maxrss_bytes()}


# -- torch DDP on gloo processes ------------------------------------------------------------------
def _gloo_rank(rank, world, steps, store, outdir):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from model import GPT, preset
    from playground.data import MarkovSource
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = preset("small")
    model = TorchDDP(GPT(cfg, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    source = MarkovSource(cfg.vocab_size, 0)
    times, losses = [], []
    for step in range(steps):
        t = time.perf_counter()
        batch = source.global_batch(step, world * MICRO_BATCH, cfg.seq_len)[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump({"step_s": times, "loss": losses, "peak_rss_bytes": _maxrss_bytes()}, f)


def one_gloo(world: int, steps: int) -> dict:
    import torch.multiprocessing as mp
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_gloo_rank, args=(world, steps, os.path.join(d, "store"), d), nprocs=world)
        ranks = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]
    return {"end_to_end_s": time.perf_counter() - t0, "step_s": ranks[0]["step_s"], "loss": ranks[0]["loss"],
            "peak_rss_bytes": sum(r["peak_rss_bytes"] for r in ranks) + _maxrss_bytes()}


def in_subprocess(backend: str, world: int, steps: int, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", backend, "--world", str(world), "--steps", str(steps)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "why": f"timeout after {timeout:.0f} s"}
    if p.returncode != 0:
        return {"ok": False, "why": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"}
    return {"ok": True, **json.loads(p.stdout.strip().splitlines()[-1])}


def scaling(backend: str, sizes, first: tuple, timeout: float) -> list:
    """Largest world each backend completes (2 steps). A size whose predicted peak memory
    exceeds 90% of MemAvailable is not attempted, so the probe never drives the machine
    into the OOM killer: the prediction extends the last completed run by the marginal
    bytes per rank between the last two completed runs (`first`: (world, bytes) of the
    main comparison)."""
    rows = []
    done = [first]
    for n in sizes:
        (n0, b0), (n1, b1) = (done[-2] if len(done) > 1 else (0, 0)), done[-1]
        marginal = (b1 - b0) / (n1 - n0)
        predicted = b1 + (n - n1) * marginal
        available = _meminfo()
        if predicted > 0.9 * available:
            rows.append({"world": n, "ok": False, "why": f"not attempted: predicted {predicted / 2**30:.1f} GiB "
                                                          f"> 90% of {available / 2**30:.1f} GiB available"})
            break
        r = in_subprocess(backend, n, 2, timeout)
        rows.append({"world": n, "predicted_bytes": predicted,
                     **{k: v for k, v in r.items() if k in ("ok", "why", "end_to_end_s", "peak_rss_bytes")}})
        if not r["ok"]:
            break
        done.append((n, r["peak_rss_bytes"]))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--one", choices=["sim", "gloo"], help=argparse.SUPPRESS)
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--reps", type=int, default=3, help="alternating sim/gloo repetitions (medians reported)")
    ap.add_argument("--json", default=default_json("ddp_vs_gloo"))
    args = ap.parse_args()
    if args.one:
        out = one_sim(args.world, args.steps) if args.one == "sim" else one_gloo(args.world, args.steps)
        print(json.dumps(out))
        return

    reps = {"sim": [], "gloo": []}
    for _ in range(args.reps):  # alternate, so drifts in the machine's speed hit both
        for b in ("sim", "gloo"):
            r = in_subprocess(b, args.world, args.steps, 1800)
            if not r["ok"]:
                sys.exit(f"{b} run failed: {r['why']}")
            reps[b].append(r)
    skip = 1  # the first step warms up (allocator, autograd graph)
    summary = {b: {"median_step_s": median(median(r["step_s"][skip:]) for r in rs),
                   "end_to_end_s": median(r["end_to_end_s"] for r in rs),
                   "peak_rss_bytes": median(r["peak_rss_bytes"] for r in rs),
                   "per_rep_median_step_s": [median(r["step_s"][skip:]) for r in rs],
                   "per_rep_end_to_end_s": [r["end_to_end_s"] for r in rs],
                   "final_loss": rs[0]["loss"][-1]} for b, rs in reps.items()}
    s, g = summary["sim"], summary["gloo"]
    s_step, g_step = s["median_step_s"], g["median_step_s"]
    rows = [["median step", f"{s_step * 1e3:.0f} ms", f"{g_step * 1e3:.0f} ms", f"{s_step / g_step:.2f}", "<= 1.0"],
            ["end to end", f"{s['end_to_end_s']:.1f} s", f"{g['end_to_end_s']:.1f} s",
             f"{s['end_to_end_s'] / g['end_to_end_s']:.2f}", "<= 0.5"],
            ["peak memory", f"{s['peak_rss_bytes'] / 2**30:.2f} GiB", f"{g['peak_rss_bytes'] / 2**30:.2f} GiB",
             f"{s['peak_rss_bytes'] / g['peak_rss_bytes']:.2f}", "-"],
            ["final loss", f"{s['final_loss']:.4f}", f"{g['final_loss']:.4f}", "", ""]]
    print_table(f"DDP, small GPT, {args.world} ranks, micro-batch {MICRO_BATCH}, {args.steps} steps, median of "
                f"{args.reps} alternating runs: simulated ranks vs torch DDP on gloo processes",
                ["", "sim", "gloo", "sim / gloo", "target"], rows)
    print("per run, median step (ms): sim " + ", ".join(f"{x * 1e3:.0f}" for x in s["per_rep_median_step_s"])
          + "; gloo " + ", ".join(f"{x * 1e3:.0f}" for x in g["per_rep_median_step_s"]))
    scale = {}
    if not args.no_scaling:
        for b, sizes in (("sim", [16, 32, 64, 128, 256, 512, 1024]), ("gloo", [16, 32, 48, 64, 96])):
            scale[b] = scaling(b, sizes, (args.world, summary[b]["peak_rss_bytes"]), 1800)
        srows = []
        for b in ("sim", "gloo"):
            for r in scale[b]:
                srows.append([b, r["world"], "completed" if r.get("ok") else r["why"],
                              f"{r['end_to_end_s']:.1f} s" if r.get("ok") else "",
                              f"{r['peak_rss_bytes'] / 2**30:.2f} GiB" if r.get("ok") else ""])
        print_table("largest world completed (2 steps each)", ["backend", "world", "result", "time", "peak memory"], srows)
    write_json(args.json, {"world": args.world, "steps": args.steps, "micro_batch": MICRO_BATCH, "reps": args.reps,
                           "sim": s, "gloo": g, "runs": reps, "median_step_ratio": s_step / g_step,
                           "end_to_end_ratio": s["end_to_end_s"] / g["end_to_end_s"],
                           "memory_ratio": s["peak_rss_bytes"] / g["peak_rss_bytes"], "scaling": scale})


if __name__ == "__main__":
    main()
