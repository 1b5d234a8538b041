"""Benchmark: context parallelism at long sequences on the 1b preset's shapes. Ring
attention (zig-zag and contiguous) and Ulysses at seq 16k, 64k and 128k, cp = 1, 2, 4, 8,
16, on meta tensors (shapes only: every op timed by the roofline model on h100-datasheet, every
call by the alpha-beta model, every saved tensor measured; nothing computed). One
sequence per step, forward and backward, bf16, gradients averaged over cp with DDP.

Per layout, the worst rank: bytes sent per step by context parallelism (`cp.*` labels)
and in all, the simulated step with its compute, exposed communication and idle time,
the peak activations; and the longest sequence that fits 80 GB (h100-datasheet) beside 16 bytes
per parameter of mixed-precision model states replicated over cp (activations grow
linearly with the sequence here: attention keeps only q, k, v, its output and the
log-sum-exp, as a fused kernel does). cp = 1 runs the same ring code on a group of one.
Prints a table and writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from collectives import launch  # noqa: E402
from collectives.ledger import human_bytes  # noqa: E402
from ddp import DistributedDataParallel  # noqa: E402
from model import GPT, preset  # noqa: E402
from sequence_parallel import parallelize_context, shard_sequence  # noqa: E402
from simulator import MemoryTracker, SimulatedTime, load_hardware  # noqa: E402

HW = "h100-datasheet"


def rank_program(world, cfg, impl, balance):
    model = GPT(cfg, dtype=torch.bfloat16, device="meta")
    parallelize_context(model, world, impl, balance)
    model.materialize("meta")
    ddp = DistributedDataParallel(model, world)
    memory = MemoryTracker()
    tokens = torch.empty(1, cfg.seq_len + 1, dtype=torch.long, device="meta")
    x, y = (shard_sequence(t, model.positions) for t in (tokens[:, :-1], tokens[:, 1:]))
    clock = world.timing.clock
    before = clock.breakdown()
    with memory.track_activations(exclude=list(model.parameters())):
        loss = ddp(x, y)
        loss.backward()
    after = clock.breakdown()
    return {"peak_activations": memory.peak_activations, **{k: after[k] - before[k] for k in after}}


def measure(seq: int, cp: int, impl: str, balance: str) -> dict:
    cfg = preset("1b", seq_len=seq)
    res = launch(rank_program, cp, args=(cfg, impl, balance), time_model=SimulatedTime(HW))
    worst = max(range(cp), key=lambda r: res.values[r]["time"])
    v = res.values[worst]
    entries = res.ledger.for_rank(worst)
    return {"seq": seq, "cp": cp, "impl": impl, "balance": balance, "rank": worst,
            "cp_bytes_sent": sum(e.bytes_sent for e in entries if e.label.startswith("cp.")),
            "bytes_sent": sum(e.bytes_sent for e in entries if not e.label.endswith("broadcast")),
            "step_s": v["time"], "compute_s": v["compute"], "exposed_comm_s": v["exposed_comm"], "idle_s": v["idle"],
            "compute_spread": max(x["compute"] for x in res.values.copy()) / min(x["compute"] for x in res.values),
            "peak_activations": max(x["peak_activations"] for x in res.values)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="16384,65536,131072")
    ap.add_argument("--cps", default="1,2,4,8,16")
    ap.add_argument("--json", default=default_json("context_parallel"))
    args = ap.parse_args()
    cfg = preset("1b")
    states = 16 * cfg.n_params()  # bf16 weights and gradients, fp32 master and AdamW moments
    hbm = load_hardware(HW).hbm_capacity
    rows, out = [], []
    for seq in (int(s) for s in args.seqs.split(",")):
        for cp in (int(c) for c in args.cps.split(",")):
            variants = [("ring", "zigzag")] if cp == 1 else [("ring", "zigzag"), ("ring", "contiguous"), ("ulysses", "zigzag")]
            for impl, balance in variants:
                if impl == "ulysses" and cfg.n_heads % cp:
                    continue
                m = measure(seq, cp, impl, balance)
                per_token = m["peak_activations"] / seq
                m["fits_seq"] = int((hbm - states) / per_token) if hbm > states else 0
                out.append(m)
                name = "1 GPU" if cp == 1 else f"{impl}" + (f" {balance}" if impl == "ring" else "")
                rows.append([f"{seq // 1024}k", cp, name, human_bytes(m["cp_bytes_sent"]), human_bytes(m["bytes_sent"]),
                             f"{m['step_s'] * 1e3:.1f} ms", f"{m['compute_s'] * 1e3:.1f} ms",
                             f"{m['exposed_comm_s'] * 1e3:.1f} ms", f"{m['idle_s'] * 1e3:.1f} ms",
                             f"{m['compute_spread']:.2f}", human_bytes(m["peak_activations"]),
                             f"{m['fits_seq'] // 1024}k"])
                print(" ".join(str(c) for c in rows[-1]), flush=True)
    print_table(f"context parallelism on 1b shapes (d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads), "
                f"one sequence per step, bf16, meta tensors, simulated on {HW}; per rank, the slowest",
                ["seq", "cp", "attention", "CP bytes sent", "all bytes sent", "step", "compute", "exposed comm",
                 "idle", "compute max/min", "activations (peak)", "seq that fits 80 GB"], rows)
    print(f"model states: 16 bytes/param × {cfg.n_params():,} = {human_bytes(states)} per rank (replicated over cp); "
          f"'fits' = (HBM − states) / (peak activations per token); compute max/min over the cp ranks")
    write_json(args.json, {"config": cfg.to_dict(), "hardware": HW, "model_states": states, "results": out})


if __name__ == "__main__":
    main()
