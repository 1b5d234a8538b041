"""Benchmark: pipeline schedules at p = 4. For m in {4, 8, 16, 32} and
every schedule (GPipe, 1F1B, interleaved with v = 2, ZB-H1): the bubble measured on the
simulated clock with equal stage costs (F = 1 ms, B = 2 ms; ZB-H1's I = W = 1 ms; sends
and receives timed by the cost model on h100-sxm) beside the theory, the peak activation
memory on the first stage and the largest over ranks (measured as autograd saves
tensors), and the bytes each rank sends per step between stages. Model: the small GPT
with 8 blocks (two per stage, one per chunk when interleaved), 4 sequences per
microbatch. Prints a table and writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.bubble import measure, theory  # noqa: E402
from playground.report import human_bytes  # noqa: E402

P = 4
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1", 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatches", default="4,8,16,32")
    ap.add_argument("--json", default=default_json("pipeline"))
    args = ap.parse_args()
    cfg = preset("small", n_layers=8)
    rows, out = [], []
    for m in (int(x) for x in args.microbatches.split(",")):
        for schedule, v in SCHEDULES:
            run = RunConfig(model=cfg, layout=Layout(pp=P, schedule=schedule, virtual_stages=v, microbatches=m,
                                                     micro_batch_size=4), progress=False)
            r = measure(run)
            sent = max(sum(e.bytes_sent for e in r["ledger"].for_rank(k) if e.label.startswith("pp.")) for k in range(P))
            acts = r["peak_activations"]
            rows.append([m, schedule + (f" (v={v})" if v > 1 else ""), f"{r['bubble']:.3f}",
                         f"{theory(schedule, P, m, v):.3f}", human_bytes(acts[0]), human_bytes(max(acts)),
                         human_bytes(sent), f"{r['step'] * 1e3:.2f} ms"])
            out.append({"microbatches": m, "schedule": schedule, "virtual_stages": v, "bubble": r["bubble"],
                        "bubble_theory": theory(schedule, P, m, v), "peak_activations": acts,
                        "pp_bytes_sent_per_step_max": sent, "step_s": r["step"]})
    print_table(f"pipeline schedules, p={P}, small GPT with 8 blocks, 4 sequences per microbatch, equal stage costs "
                f"(F 1 ms, B 2 ms, ZB-H1 I = W = 1 ms)",
                ["m", "schedule", "bubble", "theory", "activations rank 0", "activations max", "pp sent/step (max)",
                 "step"], rows)
    print("theory: (p-1)/(m+p-1) GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved, (p-1)/(3m+p-1) ZB-H1 "
          "(a third of 1F1B's bubble time)")
    write_json(args.json, {"p": P, "results": out})


if __name__ == "__main__":
    main()
