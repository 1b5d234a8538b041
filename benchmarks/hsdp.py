"""Benchmark: hybrid sharding (HSDP; Zhao et al. 2023, FSDP's HYBRID_SHARD) held to one device
and to its closed forms, on simulated ranks.

Prints (1) the float64 equivalence check of HSDP alone and composed with TP + SP, PP, CP and
EP, at non-power-of-two shard and replica counts, and of a sabotage (each shard's
all-reduce sent over the shard group instead of across the replicas): the worst error over
its tolerance (at most 1 passes); (2) per rank per step, the bytes ZeRO moves under HSDP
by kind (reduce-scatter within the shard group, all-reduce across the replicas, all-gather
within the shard group) against the closed form from the units' padded lengths (the bytes
by link, within a node and across nodes, are in every plan's and training run's report).
Writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from model import GPT, preset  # noqa: E402
from playground import Layout, RunConfig, check, train  # noqa: E402
from playground.data_parallel import zero_units  # noqa: E402
from zero.zero import unit_specs  # noqa: E402

TINY = preset("tiny", n_layers=4, d_model=48, n_heads=4, d_ff=96, vocab_size=61)
LAYOUTS = [
    ("HSDP 3 shards × 2 replicas, ZeRO-3", Layout(dp=6, dp_replicate=2, zero=3, microbatches=2), TINY),
    ("HSDP 2 shards × 3 replicas, ZeRO-2", Layout(dp=6, dp_replicate=3, zero=2), TINY),
    ("HSDP 2×2, ZeRO-1 × TP 2 + SP", Layout(dp=4, dp_replicate=2, zero=1, tp=2, sequence_parallel=True), TINY),
    ("HSDP 2×2, ZeRO-1 × PP 2", Layout(dp=4, dp_replicate=2, zero=1, pp=2, microbatches=2), TINY),
    ("HSDP 2×2, ZeRO-3 × CP 2", Layout(dp=4, dp_replicate=2, zero=3, cp=2), TINY),
    ("HSDP 3×2, ZeRO-2 × EP 2 (tiny-moe)", Layout(dp=6, dp_replicate=2, zero=2, ep=2), preset("tiny-moe")),
]


def equivalence() -> list:
    rows = []
    for name, layout, model in LAYOUTS:
        rep = check(RunConfig(model=model, layout=layout, dtype="float64", steps=2, progress=False))
        rows.append({"layout": name, "passed": rep.passed, "worst_over_tolerance": rep.ratio})
    return rows


def sabotaged() -> dict:
    """Each shard's all-reduce over the shard group (as the test's sabotage plants it)."""
    import zero.zero as zz
    real = zz.ZeroDataParallel.__init__

    def wrong(self, module, group, *a, replicate=None, **k):
        real(self, module, group, *a, replicate=group if replicate is not None else None, **k)
    zz.ZeroDataParallel.__init__ = wrong
    try:
        name, layout, model = LAYOUTS[0]
        rep = check(RunConfig(model=model, layout=layout, dtype="float64", steps=2, progress=False))
    finally:
        zz.ZeroDataParallel.__init__ = real
    return {"layout": name + ", replicas reduced over the shard group", "passed": rep.passed,
            "worst_over_tolerance": rep.ratio}


def ledger(stage: int, S: int = 4, R: int = 2) -> dict:
    """Bytes sent per rank per step by kind, measured and by the closed form (float32)."""
    width, steps = 4, 2
    res = train(RunConfig(model=TINY, layout=Layout(dp=S * R, dp_replicate=R, zero=stage), steps=steps,
                          progress=False))
    sent: dict = {}
    for e in res.ledger.per_rank[0]:
        if e.label.startswith("zero."):
            kind = e.label.split(".")[1]
            sent[kind] = sent.get(kind, 0) + e.bytes_sent / steps
    model = GPT(TINY, device="meta")
    units = [-(-sum(p.numel() for _, p in ps) // S) * S for _, _, ps in unit_specs(model, zero_units(model))]
    scatter = sum((S - 1) / S * n * width for n in units)
    # reduce-scatter within the shard group, all-reduce of the shard across the replicas, the
    # parameters all-gathered within the shard group after the step (stage 1) or around forward
    # and backward (stage 3: twice)
    closed = {"grads": scatter, "replicate": sum(2 * (R - 1) / R * n / S * width for n in units),
              "params": scatter, "gather": 2 * scatter}
    return {"stage": stage, "shards": S, "replicas": R,
            "rows": [{"kind": k, "measured": sent.get(k, 0), "closed_form": closed.get(k)} for k in sorted(sent)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=default_json("hsdp"))
    a = ap.parse_args()
    rows = equivalence() + [sabotaged()]
    print_table("HSDP against one device, float64, 2 steps (worst error over its tolerance: at most 1 passes)",
                ["layout", "verdict", "worst / tolerance"],
                [[r["layout"], "PASS" if r["passed"] else "FAIL", f"{r['worst_over_tolerance']:.3g}"] for r in rows])
    books = [ledger(1), ledger(3)]
    for b in books:
        print_table(f"ZeRO-{b['stage']} under HSDP, {b['shards']} shards × {b['replicas']} replicas: bytes sent per rank "
                    f"per step (rank 0)", ["kind", "measured", "closed form"],
                    [[r["kind"], f"{r['measured']:,.0f}", f"{r['closed_form']:,.0f}" if r["closed_form"] is not None
                      else "-"] for r in b["rows"]])
    write_json(a.json, {"benchmark": "hsdp", "equivalence": rows, "ledger": books})


if __name__ == "__main__":
    main()
