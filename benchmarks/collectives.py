"""Benchmark: the process-group layer: all_reduce throughput, small-message latency up to
1024 ranks, one program on sim against gloo.

1. all_reduce of 64 MiB float32 per rank at 8 ranks, against a NumPy bound measured in
   the same run (sum the 8 arrays into one, copy the result back to each). Target: the
   simulator reaches at least 0.5 of the bound's throughput.
2. Latency of a 4-byte all_reduce at 8, 64, 256 and 1024 ranks: median over calls of the
   time from the first rank entering to the last rank leaving. Targets: at most 1.5 ms at
   64 ranks and at most 40 ms at 1024 ranks. A bare rendezvous (one lock per thread, no
   collective work at all) is measured beside it as the floor of this machine.
3. The same small program (all_reduce, all_gather, broadcast of 1 MiB, 20 rounds) end to
   end at 8 ranks on the simulator and on 8 gloo processes.

Prints a table and writes JSON (collectives.json in the current folder by default).
"""
import argparse
import os
import sys
import threading
import time

import numpy as np
import torch

# run as a script, this file's folder comes first on sys.path and its name would shadow
# the collectives package: put the repository root there instead
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402
from collectives import launch  # noqa: E402


# -- 1. throughput --------------------------------------------------------------------------
def _big_allreduce(world, numel, reps):
    x = np.random.default_rng(world.rank).standard_normal(numel, dtype=np.float32)
    spans = []
    for _ in range(reps):
        world.barrier()
        a = time.perf_counter()
        world.all_reduce(x)
        spans.append((a, time.perf_counter()))
    return spans


def _span(values, i):
    return max(v[i][1] for v in values) - min(v[i][0] for v in values)


def throughput(n=8, mib=64, reps=5):
    numel = mib * 2**20 // 4
    res = launch(_big_allreduce, n, args=(numel, reps))
    sim = median(_span(res.values, i) for i in range(reps))
    del res
    arrays = [np.random.default_rng(r).standard_normal(numel, dtype=np.float32) for r in range(n)]
    bound = []
    for _ in range(reps):
        a = time.perf_counter()
        acc = arrays[0].copy()
        for x in arrays[1:]:
            np.add(acc, x, out=acc)
        for x in arrays:
            np.copyto(x, acc)
        bound.append(time.perf_counter() - a)
    bound = median(bound)
    size = numel * 4
    return {"ranks": n, "bytes_per_rank": size, "sim_s": sim, "bound_s": bound,
            "sim_GBps": size / sim / 1e9, "bound_GBps": size / bound / 1e9, "fraction_of_bound": bound / sim,
            "target_fraction": 0.5}


# -- 2. latency -------------------------------------------------------------------------------
def _small_allreduce(world, iters):
    x = np.zeros(1, dtype=np.float32)
    spans = []
    for _ in range(iters):
        a = time.perf_counter()
        world.all_reduce(x)
        spans.append((a, time.perf_counter()))
    return spans


def _bare_rendezvous(n, iters):
    """The floor: threads meeting at a barrier with one wake lock each and nothing else."""
    mutex = threading.Lock()
    locks = [threading.Lock() for _ in range(n)]
    for lk in locks:
        lk.acquire()
    state = {"arrived": 0, "waiting": []}
    spans = [[None] * iters for _ in range(n)]

    def body(r):
        for i in range(iters):
            a = time.perf_counter()
            with mutex:
                state["arrived"] += 1
                last = state["arrived"] == n
                if last:
                    waiting, state["waiting"], state["arrived"] = state["waiting"], [], 0
                else:
                    state["waiting"].append(r)
            if last:
                for w in waiting:
                    locks[w].release()
            else:
                locks[r].acquire()
            spans[r][i] = (a, time.perf_counter())

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return median(_span(spans, i) for i in range(iters))


def latency(sizes, quick=False):
    rows = []
    targets = {64: 1.5e-3, 1024: 40e-3}
    for n in sizes:
        iters = {8: 2000, 64: 300, 256: 60, 1024: 20}.get(n, 50)
        if quick:
            iters = max(10, iters // 10)
        res = launch(_small_allreduce, n, args=(iters,))
        warm = iters // 10  # leave out the first calls, while threads are still starting
        sim = median(_span(res.values, i) for i in range(warm, iters))
        rows.append({"ranks": n, "calls": iters - warm, "sim_s": sim, "bare_rendezvous_s": _bare_rendezvous(n, iters),
                     "target_s": targets.get(n)})
    return rows


# -- 3. sim against gloo ------------------------------------------------------------------------
def small_program(world, rounds=20):
    x = torch.ones(2**18)  # 1 MiB
    out = torch.empty(world.size * 2**16)
    for _ in range(rounds):
        world.all_reduce(x, label="ar")
        world.all_gather(out, x[: 2**16], label="ag")
        world.broadcast(x, src=0, label="bc")
    return float(x[0])


def sim_vs_gloo(n=8):
    out = {}
    for backend in ("sim", "gloo"):
        a = time.perf_counter()
        res = launch(small_program, n, backend=backend)
        out[backend] = {"end_to_end_s": time.perf_counter() - a, "bytes_sent_rank0": res.ledger.bytes_sent(0)}
    assert out["sim"]["bytes_sent_rank0"] == out["gloo"]["bytes_sent_rank0"]
    out["gloo_over_sim"] = out["gloo"]["end_to_end_s"] / out["sim"]["end_to_end_s"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, a few seconds (a demo, not a measurement)")
    ap.add_argument("--json", default=default_json("collectives"))
    args = ap.parse_args()

    if args.quick:
        demo = launch(small_program, 8, kwargs={"rounds": 2})
        print("8 simulated ranks, 2 rounds of all_reduce / all_gather / broadcast of 1 MiB:\n")
        print(demo.ledger.table(by="label"))
        thr = throughput(n=8, mib=4, reps=3)
        lat = latency([8, 64], quick=True)
        s_vs_g = None
    else:
        thr = throughput()
        lat = latency([8, 64, 256, 1024])
        s_vs_g = sim_vs_gloo()

    print_table("all_reduce throughput (float32, median)", ["ranks", "MiB/rank", "sim", "NumPy bound", "fraction", "target"],
                [[thr["ranks"], thr["bytes_per_rank"] // 2**20, f"{thr['sim_s'] * 1e3:.1f} ms ({thr['sim_GBps']:.2f} GB/s)",
                  f"{thr['bound_s'] * 1e3:.1f} ms ({thr['bound_GBps']:.2f} GB/s)", f"{thr['fraction_of_bound']:.2f}",
                  ">= 0.50"]])
    print_table("4-byte all_reduce latency (median, first rank in to last rank out)",
                ["ranks", "calls", "sim", "bare rendezvous (floor)", "target"],
                [[r["ranks"], r["calls"], f"{r['sim_s'] * 1e3:.3f} ms", f"{r['bare_rendezvous_s'] * 1e3:.3f} ms",
                  f"<= {r['target_s'] * 1e3:.1f} ms" if r["target_s"] else "-"] for r in lat])
    if s_vs_g:
        print_table("same program, 8 ranks, end to end (launch included)", ["backend", "time", "bytes sent by rank 0"],
                    [[b, f"{s_vs_g[b]['end_to_end_s']:.2f} s", s_vs_g[b]["bytes_sent_rank0"]] for b in ("sim", "gloo")]
                    + [["gloo / sim", f"{s_vs_g['gloo_over_sim']:.1f}x", ""]])
    if not args.quick:
        write_json(args.json, {"throughput": thr, "latency": lat, "sim_vs_gloo": s_vs_g})


if __name__ == "__main__":
    main()
