"""Benchmark: the playground against plain PyTorch on GPUs, from the logs of
benchmarks/side_by_side_gpu.sh and benchmarks/ac_gpu.sh (committed under
benchmarks/results/gpu/). Each pair ran in one call on the same machine, one after the
other: `torch_MODE_...json` (benchmarks/gpu_side_by_side.py: torch DDP, FSDP2 or one GPU)
and `pg_STRATEGY_...json` (`playground train --backend torch --json`) with the same model,
micro-batch and activation checkpointing; DDP pairs with the playground's DDP, FSDP2 with
ZeRO-3. Prints per pair the median-step tokens/s of each side, their ratio, MFU and CUDA's
peak allocated memory. Where the same call also ran the playground of an earlier tree
(`old_...json`, benchmarks/before_after_gpu.sh), its tokens/s and this tree's over it are
printed beside them. Writes JSON.
"""
import argparse
import glob
import json
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from benchmarks.gpu_runs import read  # noqa: E402
from model import GPTConfig  # noqa: E402
from simulator import load_hardware  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu")
PEER = {"ddp": "ddp", "fsdp2": "zero3", "single": "single"}


def playground_side(m: dict, hardware: str) -> dict:
    cfg = GPTConfig(**{k: v for k, v in m["model"].items() if k != "n_params"})
    tokens, world = m["throughput"]["tokens_per_s"], m["layout"]["world"]
    strategy = (f"zero{m['layout']['zero']}" if m["layout"]["zero"] else "ddp" if world > 1 else "single") + \
        (" + bf16 copies" if m["run"].get("bf16_copies") else "")
    return {"tokens_per_s": tokens, "strategy": strategy, "cuda_peak_allocated": max(r.get("cuda_peak_allocated", 0) for r in m["memory"]),
            "mfu": cfg.mfu(tokens, world, load_hardware(hardware).peak_bf16_flops)}


def pairs(folders, hardware: str) -> list:
    rows = []
    for folder in folders:
        files = {name: json.loads(text) for name, text in read(folder, "*.json")
                 if name.startswith(("torch_", "pg_", "old_"))}
        for name, t in files.items():
            if not name.startswith("torch_"):
                continue
            pair = name[len("torch_"):-len(".json")]
            mine = "pg_" + pair.replace(t["mode"], PEER[t["mode"]], 1) + ".json"
            if mine not in files:
                continue
            p = playground_side(files[mine], hardware)
            old = files.get("old_" + mine[len("pg_"):])
            rows.append({"run": os.path.basename(os.path.normpath(folder)), "pair": pair, "model": t["model"],
                         "mbs": t["mbs"], "ac": t["ac"], "world": t["world"], "torch": t, "playground": p,
                         "ratio": p["tokens_per_s"] / t["tokens_per_s"],
                         "earlier_tree": playground_side(old, hardware) if old is not None else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="*", help="folders of pairs (default: every run under benchmarks/results/gpu)")
    ap.add_argument("--hardware", default="h200", help="the profile whose peak MFU is taken of")
    ap.add_argument("--json", default=default_json("side_by_side"))
    a = ap.parse_args()
    rows = pairs(a.folders or sorted(glob.glob(os.path.join(RESULTS, "run*"))), a.hardware)
    if not rows:
        sys.exit("side_by_side: no pairs of torch_*.json and pg_*.json found")
    gib = 2 ** 30
    print_table("the playground beside plain PyTorch (bf16, median step; each pair in one GPU call)",
                ["run", "model", "GPUs", "micro-batch", "ac", "compile", "torch", "tokens/s", "playground", "tokens/s", "ratio",
                 "MFU torch / playground", "CUDA peak torch / playground", "earlier tree", "this / earlier"],
                [[r["run"], r["model"], r["world"], r["mbs"], r["ac"], "yes" if r["torch"].get("compile") else "no",
                  r["torch"]["mode"],
                  f"{r['torch']['tokens_per_s']:,.0f}", r["playground"]["strategy"],
                  f"{r['playground']['tokens_per_s']:,.0f}", f"{r['ratio']:.2f}",
                  f"{r['torch']['mfu']:.1%} / {r['playground']['mfu']:.1%}",
                  f"{r['torch']['cuda_peak_allocated'] / gib:.1f} / {r['playground']['cuda_peak_allocated'] / gib:.1f} GiB",
                  f"{r['earlier_tree']['tokens_per_s']:,.0f}" if r["earlier_tree"] else "-",
                  f"{r['playground']['tokens_per_s'] / r['earlier_tree']['tokens_per_s']:.2f}" if r["earlier_tree"] else "-"]
                 for r in rows])
    write_json(a.json, {"benchmark": "side_by_side", "rows": rows})


if __name__ == "__main__":
    main()
