"""Benchmark: the memory audit (playground/memory_audit.py) over random layouts, the check
sweep's draws (benchmarks/check_sweep.py `draw`: tiny and small presets with their shapes
redrawn, dense and MoE, every axis and their compositions up to 8 ranks, every dtype and
recomputation mode), each run as a plan runs it (`planning.planned_run`).

    python benchmarks/memory_audit_sweep.py [--configs 100] [--seed 3] [--workers 2] [--json F]

Per configuration the rank whose tracked peak is furthest from the live count's: live −
tracked, in bytes and as a share of tracked (> 0: the program holds what the plan does not
count, the plan optimistic; < 0: the plan counts more than it holds). A configuration whose
plan raises counts as a failure. The drawn models are tiny (activations of tens of KB), so
the few small tensors the two count differently (the rotary tables made before the step
and saved in it, a few KB) weigh more than in benchmarks/memory_audit.py's model: the
table reports both bytes and shares. Prints the distribution and the furthest ten; writes
JSON.
"""
import argparse
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402


def one(index: int, seed: int) -> dict:
    """Configuration `index` of the sweep seeded `seed`, audited on h100-sxm."""
    import dataclasses

    import torch
    torch.set_num_threads(1)
    from benchmarks.check_sweep import describe, draw
    from playground.memory_audit import audit
    run, _ = draw(random.Random(f"{seed}:{index}"))
    run = dataclasses.replace(run, hardware="h100-sxm")
    row = {"index": index, "config": describe(run), "dtype": run.dtype, "moe": bool(run.model.n_experts)}
    try:
        ranks = audit(run)
    except Exception as e:  # noqa: BLE001 (a plan that raises is a failure of the sweep)
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"[:300]}
    worst = max(ranks, key=lambda r: abs(r["missed"]) / max(r["tracked"], 1))
    return {**row, "tracked": worst["tracked"], "live": worst["live"], "missed": worst["missed"],
            "share": worst["missed"] / max(worst["tracked"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=default_json("memory_audit_sweep"))
    a = ap.parse_args()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(a.workers) as pool:
        rows = list(pool.map(one, range(a.configs), [a.seed] * a.configs))
    done = [r for r in rows if "error" not in r]
    failed = [r for r in rows if "error" in r]
    shares = sorted(abs(r["share"]) for r in done)
    within = lambda f: sum(s <= f for s in shares)  # noqa: E731
    print_table(f"memory audit over {a.configs} random configurations (seed {a.seed}), "
                f"{time.perf_counter() - t0:.0f} s: live − tracked at the rank furthest apart",
                ["audited", "plan raised", "within 1%", "within 2%", "within 5%", "median |share|",
                 "most over (plan optimistic)", "most under"],
                [[len(done), len(failed), within(0.01), within(0.02), within(0.05),
                  f"{median(shares):.2%}" if shares else "-",
                  f"{max(r['share'] for r in done):+.2%}" if done else "-",
                  f"{min(r['share'] for r in done):+.2%}" if done else "-"]])
    furthest = sorted(done, key=lambda r: -abs(r["share"]))[:10]
    print_table("the furthest ten", ["#", "live − tracked", "of tracked", "configuration"],
                [[r["index"], f"{r['missed']:+,} B", f"{r['share']:+.2%}", r["config"]] for r in furthest])
    for r in failed:
        print(f"plan raised, #{r['index']}: {r['error']} | {r['config']}")
    write_json(a.json, {"benchmark": "memory_audit_sweep", "seed": a.seed, "configs": a.configs, "rows": rows})


if __name__ == "__main__":
    main()
