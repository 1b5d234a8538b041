"""Benchmark: goodput under failures, on simulated ranks, against Young's and Daly's formula
(playground/goodput.py). Time is counted in steps: a step takes 1, a checkpoint δ, a restart
R; failures arrive at exponentially distributed times of mean M (in the same units), during
steps, checkpoints and recomputation alike, as Daly's model has them.

For each checkpoint interval k (steps), `--seeds` failure histories are drawn; each history
is turned into the crashes it injects (a failure during step j is `crash@j:1`, j counted from
1; the restart resumes at the last checkpoint) and trained for real (tiny, dp 2, `--steps`
steps, `--save-every k`, `--max-restarts` as many as the crashes), so the run's own restarts
say which steps were recomputed. The table: per k, the goodput of the histories (useful steps
over the time spent, failures, checkpoints and restarts included, summed over the seeds: the
ratio of the expectations, as Daly's T_s / T_w is),
Daly's expected goodput at k, the steps the runs recomputed against what the histories
predict, and whether every run ended bit-identical to the uninterrupted one. Prints the
table and writes JSON.
"""
import argparse
import os
import random
import sys
import tempfile

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig, train  # noqa: E402
from playground.checkpoint import export  # noqa: E402
from playground.faults import Fault  # noqa: E402
from playground.goodput import daly_interval, goodput, young_interval  # noqa: E402


def history(steps: int, k: int, mtbf: float, delta: float, restart: float, rng) -> tuple:
    """(the crashes a failure history injects, the time it takes, the steps it recomputes)."""
    time, done, saved, recomputed, crashes = 0.0, 0, 0, 0, []
    failure = rng.expovariate(1 / mtbf)
    while done < steps:
        end = time + 1 + (delta if (done + 1) % k == 0 or done + 1 == steps else 0)  # the step, and its checkpoint
        if failure < end:  # it fails in step done + 1 (or while checkpointing it): back to the last checkpoint
            crashes.append(Fault("crash", done + 1, 1))
            recomputed += done - saved
            time, done = failure + restart, saved
            failure = time + rng.expovariate(1 / mtbf)
            continue
        time, done = end, done + 1
        if done % k == 0 or done == steps:
            saved = done
    return crashes, time, recomputed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--mtbf", type=float, default=16.0, help="mean steps between failures")
    ap.add_argument("--delta", type=float, default=0.5, help="a checkpoint's cost, in steps")
    ap.add_argument("--restart", type=float, default=2.0, help="a restart's cost, in steps")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--json", default=default_json("faults"))
    a = ap.parse_args()
    run = RunConfig(model=preset("tiny"), layout=Layout(dp=2), steps=a.steps, progress=False)
    with tempfile.TemporaryDirectory() as d:
        train(RunConfig(**{**run.__dict__, "save": os.path.join(d, "whole")}))
        whole = export(os.path.join(d, "whole"))
        rows, out = [], []
        for k in (1, 2, 4, 8, 16, 48):
            rng = random.Random(k)
            spent, predicted, recomputed, identical, failures = 0.0, 0, 0, True, 0
            for seed in range(a.seeds):
                crashes, took, lost = history(a.steps, k, a.mtbf, a.delta, a.restart, rng)
                folder = os.path.join(d, f"k{k}_{seed}")
                res = train(RunConfig(**{**run.__dict__, "save": folder, "save_every": k, "faults": tuple(crashes),
                                         "max_restarts": len(crashes)}))
                got = export(folder)
                identical &= all(torch.equal(got[n], whole[n]) for n in whole)
                recomputed += sum(r.steps_recomputed for r in res.restarts)
                predicted += lost
                failures += len(crashes)
                spent += took
            daly = goodput(k, a.delta, a.mtbf, a.restart)
            row = {"interval_steps": k, "goodput_measured": a.seeds * a.steps / spent, "goodput_daly": daly,
                   "failures": failures, "steps_recomputed": recomputed, "steps_recomputed_predicted": predicted,
                   "bit_identical": identical}
            out.append(row)
            rows.append([k, f"{100 * row['goodput_measured']:.1f}%", f"{100 * daly:.1f}%", failures,
                         f"{recomputed} / {predicted}", "yes" if identical else "NO"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    tau_y, tau_d = young_interval(a.delta, a.mtbf), daly_interval(a.delta, a.mtbf)
    print_table(f"goodput under failures: tiny, dp 2, {a.steps} steps, a failure every {a.mtbf:g} steps on average, "
                f"checkpoint {a.delta:g} step, restart {a.restart:g} steps; {a.seeds} histories per interval; "
                f"best interval: Young {tau_y:.2f} steps, Daly {tau_d:.2f} (goodput {100 * goodput(tau_d, a.delta, a.mtbf, a.restart):.1f}%)",
                ["checkpoint every", "goodput (histories)", "goodput (Daly)", "failures", "recomputed: runs / histories",
                 "bit-identical"], rows)
    write_json(a.json, {"benchmark": "faults", "steps": a.steps, "mtbf_steps": a.mtbf, "delta_steps": a.delta,
                        "restart_steps": a.restart, "young_steps": tau_y, "daly_steps": tau_d, "rows": out})


if __name__ == "__main__":
    main()
