"""Benchmark: `playground plan --search` with branch and bound against the search that
estimates every candidate (playground/search.py): wall time on this machine and whether
the fastest three layouts, and their steps, are the same. Searches: 70b on 1024 ranks
(global batch 1024) and 7b on 64 (global batch 256), on h100-sxm, the README's. `--full`
also runs the unpruned reference (an hour or more at 70B on 2 cores); without it the
reference is read from an earlier JSON (`--reference FILE`) where given. Writes JSON.
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
from playground.search import search  # noqa: E402

SEARCHES = {"70b-1024": ("70b", 1024, 1024), "7b-64": ("7b", 64, 256)}


def top(res, n: int = 3) -> list:
    return [{"layout": e.layout.describe(), "micro_batch": e.layout.micro_batch_size, "step_s": e.step_s,
             "exact": e.exact} for e in res.fits[:n]]


def one(name: str, prune: bool) -> dict:
    model, world, batch = SEARCHES[name]
    run = RunConfig(model=preset(model), dtype="bfloat16", hardware="h100-sxm", progress=False)
    t0 = time.perf_counter()
    res = search(run, world, batch, prune=prune)
    return {"search": name, "prune": prune, "wall_s": time.perf_counter() - t0, "considered": res.considered,
            "estimated": res.estimated, "plans": res.planned, "pruned": res.pruned,
            "bound_violations": res.bound_violations, "top": top(res)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=sorted(SEARCHES), default=None)
    ap.add_argument("--full", action="store_true", help="also run the unpruned reference search")
    ap.add_argument("--reference", default=None, help="a JSON of this benchmark holding the unpruned searches")
    ap.add_argument("--json", default=default_json("search_speed"))
    a = ap.parse_args()
    names = [a.only] if a.only else list(SEARCHES)
    rows = []
    for name in names:
        rows.append(one(name, True))
        if a.full:
            rows.append(one(name, False))
        elif a.reference:
            rows += [r for r in json.load(open(a.reference))["rows"] if r["search"] == name and not r["prune"]]
        print(json.dumps(rows[-1], indent=1), flush=True)
    table = []
    for name in names:
        got = {r["prune"]: r for r in rows if r["search"] == name}
        p, f = got.get(True), got.get(False)
        same = None if f is None else [(x["layout"], x["micro_batch"]) for x in p["top"]] == [
            (x["layout"], x["micro_batch"]) for x in f["top"]]
        table.append([name, f"{p['wall_s']:.0f} s", f"{p['estimated']} ({p['pruned']} pruned)",
                      "-" if f is None else f"{f['wall_s']:.0f} s", "-" if f is None else f["estimated"],
                      "-" if same is None else ("yes" if same else "NO"), p["bound_violations"],
                      " | ".join(f"{x['layout'].split(' (world')[0]} mbs {x['micro_batch']}: {x['step_s'] * 1e3:.0f} ms"
                                 for x in p["top"])])
    print_table("plan --search on h100-sxm: branch and bound against estimating every layout",
                ["search", "pruned search", "estimated", "full search", "estimated", "same fastest 3",
                 "estimates below bound", "fastest 3 (pruned search)"], table)
    write_json(a.json, {"benchmark": "search_speed", "rows": rows})


if __name__ == "__main__":
    main()
