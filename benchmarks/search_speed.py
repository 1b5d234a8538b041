"""Benchmark: `playground plan --search` with branch and bound against a reference search
(playground/search.py): wall time on this machine and whether the fastest three layouts,
and their steps, are the same. Searches: 70b on 1024 ranks (global batch 1024) and 7b on
64 (global batch 256), on h100-sxm, the README's. References: `--full` estimates every
candidate (hours at 70B on 2 cores); `--weakened SCALE` multiplies every step bound by
SCALE and turns the peak bound off, so it estimates every layout whose bound is within
1/SCALE of the third fastest and every one the peak bound would reject (tens of minutes at
0.8); `--reference FILE` reads them from an earlier JSON. Writes JSON.
"""
import argparse
import json
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from model import preset  # noqa: E402
from playground import RunConfig  # noqa: E402
from playground import search as search_module  # noqa: E402

SEARCHES = {"70b-1024": ("70b", 1024, 1024), "7b-64": ("7b", 64, 256)}


def top(res, n: int = 3) -> list:
    return [{"layout": e.layout.describe(), "micro_batch": e.layout.micro_batch_size, "step_s": e.step_s,
             "exact": e.exact} for e in res.fits[:n]]


def one(name: str, prune: bool, jobs: int | None, weaken: float | None = None) -> dict:
    """One search; `weaken`: a reference whose every step bound is multiplied by it (below
    1: more layouts estimated) and whose peak bound is off (every layout that passes the
    model states is estimated)."""
    model, world, batch = SEARCHES[name]
    run = RunConfig(model=preset(model), dtype="bfloat16", hardware="h100-sxm", progress=False)
    t0 = time.perf_counter()
    true_step, true_peak = search_module.step_lower_bound, search_module.memory_lower_bound
    if weaken is not None:  # (the bounds are taken in this process; the workers only estimate)
        search_module.step_lower_bound = lambda *args: weaken * true_step(*args)
        search_module.memory_lower_bound = lambda *args: 0.0
    try:
        res = search_module.search(run, world, batch, prune=prune, jobs=jobs)
    finally:
        search_module.step_lower_bound, search_module.memory_lower_bound = true_step, true_peak
    return {"search": name, "prune": prune, "weaken": weaken, "jobs": jobs or os.cpu_count(),
            "wall_s": time.perf_counter() - t0, "considered": res.considered,
            "estimated": res.estimated, "plans": res.planned, "pruned": res.pruned,
            "bound_violations": res.bound_violations, "top": top(res)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(SEARCHES), default=None)
    ap.add_argument("--full", action="store_true", help="also run the unpruned reference search")
    ap.add_argument("--weakened", type=float, default=None, metavar="SCALE",
                    help="also run a reference whose step bounds are multiplied by SCALE (< 1) and whose peak "
                         "bound is off: it estimates every layout whose bound is within 1/SCALE of the third "
                         "fastest")
    ap.add_argument("--reference", default=None, help="a JSON of this benchmark holding the reference searches")
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: the CPU count)")
    ap.add_argument("--json", default=default_json("search_speed"))
    a = ap.parse_args()
    names = [a.only] if a.only else list(SEARCHES)
    rows = []
    for name in names:
        rows.append(one(name, True, a.jobs))
        print(json.dumps(rows[-1], indent=1), flush=True)
        if a.full:
            rows.append(one(name, False, a.jobs))
            print(json.dumps(rows[-1], indent=1), flush=True)
        if a.weakened:
            rows.append(one(name, True, a.jobs, a.weakened))
            print(json.dumps(rows[-1], indent=1), flush=True)
        if a.reference:
            rows += [r for r in json.load(open(a.reference))["rows"]
                     if r["search"] == name and (not r["prune"] or r.get("weaken"))]
    table = []
    for name in names:
        pruned = next(r for r in rows if r["search"] == name and r["prune"] and not r.get("weaken"))
        for ref in [r for r in rows if r["search"] == name and r is not pruned] or [None]:
            same = None if ref is None else [(x["layout"], x["micro_batch"]) for x in pruned["top"]] == [
                (x["layout"], x["micro_batch"]) for x in ref["top"]]
            kind = "-" if ref is None else "every layout" if not ref["prune"] else f"bounds × {ref['weaken']}, no peak bound"
            table.append([name, f"{pruned['wall_s']:.0f} s", f"{pruned['estimated']} ({pruned['pruned']} pruned)",
                          kind, "-" if ref is None else f"{ref['wall_s']:.0f} s",
                          "-" if ref is None else ref["estimated"],
                          "-" if same is None else ("yes" if same else "NO"),
                          pruned["bound_violations"] + (0 if ref is None else ref["bound_violations"]),
                          " | ".join(f"{x['layout'].split(' (world')[0]} mbs {x['micro_batch']}: "
                                     f"{x['step_s'] * 1e3:.0f} ms" for x in pruned["top"])])
    print_table("plan --search on h100-sxm: branch and bound against a reference search",
                ["search", "pruned search", "estimated", "reference", "its time", "estimated", "same fastest 3",
                 "estimates below bound", "fastest 3 (pruned search)"], table)
    write_json(a.json, {"benchmark": "search_speed", "rows": rows})


if __name__ == "__main__":
    main()
