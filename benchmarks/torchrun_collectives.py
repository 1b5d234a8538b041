"""Benchmark: every collective on the torch backend under torchrun against the simulator.
Run every collective under torchrun on the torch backend (NCCL on CUDA, gloo on CPU),
check each rank's results against the simulator on the same inputs, and measure the
bus bandwidth of a large all_reduce from the ledger's measured times.

    torchrun --nproc_per_node 2 benchmarks/torchrun_collectives.py [--mib 256]
"""
import argparse
import os
import sys

import torch

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(sys.path[0], "tests"))

from collectives import launch  # noqa: E402
from programs import all_ops  # noqa: E402


def bandwidth(world, mib, iters, device):
    x = torch.ones(mib * 2**20 // 4, device=device)
    for _ in range(3):
        world.all_reduce(x, label="warmup")
    for _ in range(iters):
        world.all_reduce(x, label="bw")
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    n = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    failures = []
    for dtype in ("float32", "bfloat16", "float64"):
        real = launch(all_ops, backend="torch", args=("world", dtype), kwargs={"device": device})
        sim = launch(all_ops, n, args=("world", dtype))  # the same inputs, on simulated ranks
        for key, want in sim.values[rank].items():
            got = real.values[rank][key]
            if isinstance(want, torch.Tensor):
                tol = {"float32": 1e-5, "bfloat16": 2e-2, "float64": 1e-12}[dtype]
                if key == "reduce" and rank != n - 1:
                    continue  # unspecified off the destination
                ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
            else:
                ok = got == want
            if not ok:
                failures.append(f"{dtype} {key}")
        same_bytes = [(e.op, e.size, e.bytes_sent) for e in real.ledger.for_rank(rank)] == \
                     [(e.op, e.size, e.bytes_sent) for e in sim.ledger.for_rank(rank)]
        if not same_bytes:
            failures.append(f"{dtype} ledger bytes")
    res = launch(bandwidth, backend="torch", args=(args.mib, args.iters, device))
    bw = sorted(e.busbw for e in res.ledger.for_rank(0) if e.label == "bw")
    times = sorted(e.duration for e in res.ledger.for_rank(0) if e.label == "bw")
    if rank == 0:
        print(f"backend: {'nccl' if device.startswith('cuda') else 'gloo'}, {n} ranks, device {device}")
        print(f"every op against the simulator (float32, bfloat16, float64): "
              f"{'PASS' if not failures else 'FAIL ' + ', '.join(failures)}")
        print(f"all_reduce {args.mib} MiB float32: median {times[len(times) // 2] * 1e3:.3f} ms, "
              f"busbw median {bw[len(bw) // 2] / 1e9:.1f} GB/s (ledger, nccl-tests definition)")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
