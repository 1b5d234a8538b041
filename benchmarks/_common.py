"""Shared helpers of the benchmark scripts: the machine description and the output."""
import json
import os
import platform
import statistics

import numpy as np
import torch


def machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform()}


def default_json(name: str) -> str:
    """Where a benchmark writes its JSON by default: NAME.json in the current folder, never
    the repository's committed results (benchmarks/results/NAME.json: a developer writes
    there on purpose, with --json, the run they choose to commit)."""
    return os.path.abspath(f"{name}.json")


def median(xs) -> float:
    return float(statistics.median(xs))


def print_table(title: str, header, rows) -> None:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max([len(str(h))] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=2)
    print(f"\nwrote {path}")
