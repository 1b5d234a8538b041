"""Benchmark: the equivalence check over random correct configurations, and over every
planted bug. Proves that the check's tolerances (playground/tolerance.py) pass a correct
layout at any shape and fail a sabotaged one by orders of magnitude.

The sweep draws configurations at random (seeded): the tiny and small presets, dense and
mixture of experts, with their shapes redrawn (odd vocabularies and sequence lengths, layer
counts, heads and grouped-query key/value heads, SwiGLU widths, experts, top-k, capacity
factors and dropless routing, every other block an MoE block, shared and narrower experts,
the three routers, the balancing bias and the sequence-wise auxiliary loss), every axis (dp,
tp with and without sequence parallelism, pp with each schedule, virtual stages and uneven
stages, cp as zig-zag or contiguous ring attention or Ulysses, ep) and their compositions up
to 8 ranks, ZeRO stages and hybrid sharding, each activation checkpointing mode, micro-batch
sizes and microbatches, 1 to 5 AdamW steps, float64, float32, bfloat16 (compute copies, or
autocast without ZeRO) and float16, the 16-bit copies' gradients kept
or reduced in float32,
learning rates, weight decay, bucket sizes and reduction after backward, and
seeds; a draw the layout refuses is drawn again. Each runs `playground.check`; the table
gives the FAIL count and how close the correct layouts came to their tolerances (a row's
ratio: its worst error over its tolerance, at most 1 passes).

`--sabotage` runs the suite's planted bugs (tests marked `sabotage`) and prints, for each
check they run, how far over its tolerance the sabotaged layout lands.

    python benchmarks/check_sweep.py --configs 500            # the sweep
    python benchmarks/check_sweep.py --configs 0 --sabotage   # the planted bugs only
"""
import argparse
import math
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402

# the presets the shapes are drawn around, with how often each is taken
PRESETS = (("tiny", 4), ("tiny-moe", 3), ("small", 1), ("small-moe", 1))
MAX_WORLD = 8


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _model(rng: random.Random, name: str, tp: int, pp: int, v: int, cp: int, cp_impl: str, cp_balance: str,
           sp: bool):
    """A model around preset `name` whose shape fits the axes (the draw is free otherwise)."""
    from model import preset
    base = preset(name)
    small = name.startswith("small")
    heads = rng.choice([h for h in (2, 4, 8) if h % tp == 0] or [tp])
    head_dim = rng.choice((4, 8, 16) if not small else (16, 32))
    kv = rng.choice([k for k in _divisors(heads) if k % tp == 0 and (cp_impl != "ulysses" or k % (tp * cp) == 0)]
                    or [heads])
    layers = pp * v * rng.choice((1, 2) if pp * v > 2 else (1, 2, 3))
    # the sequence: a multiple of what cp (2·cp chunks for zig-zag) and sequence parallelism cut it into
    unit = math.lcm(2 * cp if cp_balance == "zigzag" else cp, tp * cp if sp else 1)
    seq = unit * rng.randint(max(1, 6 // unit), max(2, (40 if not small else 80) // unit))
    over = dict(vocab_size=rng.randint(17, 300), d_model=heads * head_dim, n_heads=heads,
                n_kv_heads=kv if kv != heads or rng.random() < 0.5 else 0, n_layers=layers, seq_len=seq,
                d_ff=tp * rng.randint(4, 48 if not small else 96))
    if base.n_experts:
        experts = rng.choice((2, 3, 4, 6, 8))
        over.update(n_experts=experts, top_k=rng.randint(1, min(3, experts)),
                    capacity_factor=rng.choice((0.0, 0.5, 1.0, 1.0, 1.25, 2.0)), moe_every=rng.choice((1, 1, 2)),
                    # today's MoE (DeepSeekMoE, DeepSeek-V3): shared and narrower experts, the routers,
                    # the balancing bias and the sequence-wise loss
                    n_shared_experts=rng.choice((0, 0, 1, 2)), expert_d_ff=rng.choice((0, tp * rng.randint(2, 24))),
                    router=rng.choice(("softmax", "topk_softmax", "sigmoid")),
                    bias_update_rate=rng.choice((0.0, 0.0, 1e-3)), aux_loss=rng.choice(("batch", "batch", "sequence")))
    elif cp == 1 and rng.random() < 0.15:
        over["attention"] = "unfused"
    return base.with_(**over)


def _stage_layers(rng: random.Random, layers: int, stages: int) -> tuple | None:
    """Blocks per pipeline stage, at least one each, drawn unevenly (None: too few blocks)."""
    if layers <= stages:
        return None
    cuts = sorted(rng.sample(range(1, layers), stages - 1))
    return tuple(b - a for a, b in zip([0] + cuts, cuts + [layers]))


def draw(rng: random.Random):
    """One random RunConfig that validates (redrawn until it does); (run, attempts)."""
    from playground import Layout, LayoutError, RunConfig
    for attempt in range(1, 1000):
        name = rng.choices([p for p, _ in PRESETS], [w for _, w in PRESETS])[0]
        moe = name.endswith("moe")
        tp = rng.choice((1, 1, 2, 2, 4))
        pp = rng.choice((1, 1, 2, 3))
        cp = rng.choice((1, 1, 2, 3))
        dp = rng.choice((1, 2, 2, 3, 4))
        if dp * tp * pp * cp > MAX_WORLD:
            continue
        sp = tp > 1 and (moe or rng.random() < 0.5)
        cp_impl, cp_balance = rng.choice(("ring", "ring", "ulysses")), rng.choice(("zigzag", "zigzag", "contiguous"))
        schedule = rng.choice(("gpipe", "1f1b", "interleaved", "zb1")) if pp > 1 else "1f1b"
        v = rng.choice((2, 3)) if schedule == "interleaved" else 1
        microbatches = pp * rng.choice((1, 2)) if pp > 1 else rng.choice((1, 1, 2, 3))
        model = _model(rng, name, tp, pp, v, cp, cp_impl, cp_balance, sp)
        ep = rng.choice([e for e in _divisors(dp * cp) if model.n_experts % e == 0]) if moe else 1
        zero = rng.choice((0, 1) if pp > 1 else (0, 1, 2, 3))
        u = rng.random()
        # float16: ZeRO's loss-scaled compute copies
        fp16 = u >= 0.92
        dtype = "float64" if u < 0.55 else "float32" if u < 0.75 else "float16" if fp16 else "bfloat16"
        # bf16 as compute copies of fp32 masters (the default) or under autocast (`--autocast`)
        copies = dtype != "bfloat16" or zero > 0 or rng.random() < 0.67
        # hybrid sharding (ZeRO over dp_shard, replicated dp_replicate times) and uneven pipeline stages
        replicate = rng.choice([r for r in _divisors(dp) if r > 1] or [1]) if zero and rng.random() < 0.3 else 1
        stages = _stage_layers(rng, model.n_layers, pp * v) if pp > 1 and rng.random() < 0.3 else None
        layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, schedule=schedule, microbatches=microbatches,
                        virtual_stages=v, sequence_parallel=sp, micro_batch_size=rng.choice((1, 2, 3)),
                        cp_impl=cp_impl, cp_balance=cp_balance, dp_replicate=replicate, stage_layers=stages,
                        ac=rng.choice(("none", "none", "full", "selective", "selective-op")))
        # 16-bit compute copies beside float32 main gradients, or reduced in float32 (ZeRO)
        sixteen = dtype in ("bfloat16", "float16") and copies
        grad_dtype = "float32" if sixteen and rng.random() < 0.3 else None
        reduce_dtype = "float32" if sixteen and zero and rng.random() < 0.3 else None
        try:
            layout.validate(model)
            run = RunConfig(model=model, layout=layout, steps=rng.randint(1, 5), dtype=dtype,
                            lr=rng.choice((1e-3, 3e-3, 1e-2)), weight_decay=rng.choice((0.0, 0.0, 0.1)),
                            seed=rng.randrange(10 ** 6), progress=False,
                            bucket_cap_mb=rng.choice((25.0, 0.01)), grad_overlap=zero > 1 or rng.random() < 0.8,
                            bf16_copies=copies, grad_dtype=grad_dtype, reduce_dtype=reduce_dtype)
        except (LayoutError, ValueError):
            continue
        return run, attempt
    raise RuntimeError("no valid configuration in 1000 draws")


def describe(run) -> str:
    m, lay = run.model, run.layout
    moe = f" E{m.n_experts} k{m.top_k} cf{m.capacity_factor:g}" + (f" every{m.moe_every}" if m.moe_every > 1 else "") \
        + (f" shared{m.n_shared_experts}" if m.n_shared_experts else "") + (f" eff{m.expert_d_ff}" if m.expert_d_ff else "") \
        + (f" {m.router}" if m.router != "softmax" else "") + (" bias" if m.bias_update_rate else "") \
        + (" seq-aux" if m.aux_loss == "sequence" else "") if m.n_experts else ""
    shape = f"V{m.vocab_size} d{m.d_model} L{m.n_layers} H{m.n_heads}/{m.kv_heads} ff{m.d_ff} s{m.seq_len}{moe}"
    dtype = run.dtype + (" autocast" if run.dtype == "bfloat16" and not run.bf16_copies else "") \
        + (f" grads {run.grad_dtype}" if run.grad_dtype else "") + (f" reduced {run.reduce_dtype}" if run.reduce_dtype else "")
    return (f"{shape} | {lay.describe()}, mbs {lay.micro_batch_size} | {dtype}, {run.steps} steps, "
            f"lr {run.lr:g}, wd {run.weight_decay:g}, seed {run.seed}")


def one(index: int, seed: int, backend: str = "sim", steps: int | None = None) -> dict:
    """Draw configuration `index` of the sweep seeded `seed` and check it on `backend`
    (gloo: one process a rank), over `steps` instead of the drawn 1 to 5 when given."""
    import dataclasses

    import torch
    torch.set_num_threads(1)
    from playground import check
    run, attempts = draw(random.Random(f"{seed}:{index}"))
    run = dataclasses.replace(run, backend=backend, steps=steps or run.steps)
    row = {"index": index, "config": describe(run), "dtype": run.dtype, "steps": run.steps, "world": run.layout.world,
           "moe": bool(run.model.n_experts), "attempts": attempts}
    t0 = time.perf_counter()
    try:
        rep = check(run)
    except Exception as e:  # noqa: BLE001 (a correct layout that crashes fails the sweep as a FAIL would)
        return {**row, "by_quantity": dict.fromkeys(("loss", "grad", "weight", "moments")), "passed": False,
                "ratio": None, "closest": None, "ties": 0, "tied": 0, "seconds": time.perf_counter() - t0,
                "problems": [f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]}
    closest = max((r for r in rep.rows if r.ratio is not None), key=lambda r: r.ratio, default=None)
    by = {w: max((r.ratio for r in rep.rows if r.what == w and r.ratio is not None), default=None)
          for w in ("loss", "grad", "weight", "moments")}
    return {**row, "by_quantity": {w: (v if v != math.inf else None) for w, v in by.items()},
            "passed": rep.passed, "ratio": rep.ratio if rep.ratio != math.inf else None,
            "closest": f"{closest.what} {closest.label}" if closest else None, "problems": rep.problems[:3],
            "ties": rep.ties, "tied": rep.tied, "seconds": time.perf_counter() - t0}


def sweep(n: int, seed: int, workers: int, backend: str = "sim", steps: int | None = None) -> list:
    out = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for i, res in enumerate(pool.map(one, range(n), [seed] * n, [backend] * n, [steps] * n)):
            out.append(res)
            if (i + 1) % 25 == 0 or i + 1 == n:
                fails = sum(not r["passed"] for r in out)
                print(f"  {i + 1}/{n} checked, {fails} FAIL", flush=True)
    return out


class _Recorder:
    """A pytest plugin: every CheckReport that `playground.check` returns, by test."""

    def __init__(self):
        self.reports, self.current, self.outcomes = [], None, {}

    def pytest_configure(self, config):
        import playground
        import playground.equivalence as eq
        real = eq.check

        def recorded(run):
            rep = real(run)
            self.reports.append((self.current, rep))
            return rep
        eq.check = recorded
        playground.check = recorded  # (tests import it from either)

    def pytest_runtest_setup(self, item):
        self.current = item.nodeid.split("::", 1)[1]

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            self.outcomes[report.nodeid.split("::", 1)[1]] = report.outcome


def sabotages() -> list:
    """Every test marked `sabotage`, each check it ran: (test, passed, ratio, closest)."""
    import pytest
    rec = _Recorder()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pytest.main(["-q", "-m", "sabotage", "-p", "no:cacheprovider", os.path.join(here, "tests")], plugins=[rec])
    out = []
    for test, rep in rec.reports:
        judged = [r for r in rep.rows if r.ratio is not None]
        worst = max(judged, key=lambda r: r.ratio, default=None)
        out.append({"test": test, "outcome": rec.outcomes.get(test), "passed": rep.passed,
                    "ratio": rep.ratio if rep.ratio != math.inf else None, "problems": rep.problems[:2],
                    "worst": f"{worst.what} {worst.label}" if worst else None})
    return out


def _ratio(r) -> str:
    return "problem" if r is None else f"{r:.2e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=int, default=500, help="random configurations to check")
    ap.add_argument("--seed", type=int, default=0, help="the sweep's seed (configuration i is drawn from seed:i)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="checks run at once (processes)")
    ap.add_argument("--sabotage", action="store_true", help="also run the planted bugs (tests marked sabotage)")
    ap.add_argument("--backend", choices=("sim", "gloo"), default="sim",
                    help="where the layouts run: simulated ranks, or one gloo process a rank")
    ap.add_argument("--steps", type=int, default=None, help="AdamW steps of every configuration (default: 1 to 5)")
    ap.add_argument("--json", default=default_json("check_sweep"))
    args = ap.parse_args()
    payload = {"configs": args.configs, "seed": args.seed, "backend": args.backend, "steps": args.steps}
    if args.configs:
        t0 = time.perf_counter()
        rows = sweep(args.configs, args.seed, args.workers, args.backend, args.steps)
        wall = time.perf_counter() - t0
        payload["sweep"] = rows
        fails = [r for r in rows if not r["passed"]]
        summary = []
        for label, pick in (("all", lambda r: True), ("float64", lambda r: r["dtype"] == "float64"),
                            ("float32", lambda r: r["dtype"] == "float32"),
                            ("bfloat16", lambda r: r["dtype"] == "bfloat16"),
                            ("float16", lambda r: r["dtype"] == "float16"), ("MoE", lambda r: r["moe"]),
                            ("5 steps", lambda r: r["steps"] == 5), ("world >= 6", lambda r: r["world"] >= 6)):
            sel = [r for r in rows if pick(r)]
            ok = sorted(r["ratio"] for r in sel if r["passed"])
            if not sel:
                continue
            median = ok[len(ok) // 2] if ok else None
            worst = [max((r["by_quantity"][w] for r in sel if r["passed"] and r["by_quantity"][w] is not None),
                         default=None) for w in ("loss", "grad", "weight", "moments")]
            summary.append([label, len(sel), sum(not r["passed"] for r in sel), _ratio(ok[-1] if ok else None),
                            f"{1 / ok[-1]:.1f}x" if ok and ok[-1] else "-", _ratio(median),
                            *[_ratio(w) if w is not None else "-" for w in worst], sum(r["ties"] for r in sel)])
        where = (" on gloo" if args.backend == "gloo" else "") + (f", {args.steps} steps each" if args.steps else "")
        print_table(f"check sweep: {len(rows)} random correct configurations (seed {args.seed}{where}), "
                    f"{wall / 60:.1f} min "
                    f"(ratio: a configuration's worst error over its tolerance; by quantity: the largest over the "
                    f"passing configurations)",
                    ["configurations", "n", "FAIL", "largest ratio", "smallest margin", "median ratio", "loss", "grad",
                     "weight", "moments", "near-ties replayed"], summary)
        closest = sorted((r for r in rows if r["passed"]), key=lambda r: -r["ratio"])[:8]
        print_table("the correct configurations closest to their tolerances", ["ratio", "where", "configuration"],
                    [[_ratio(r["ratio"]), r["closest"], r["config"]] for r in closest])
        if fails:
            print_table("FAIL", ["ratio", "where", "problems", "configuration"],
                        [[_ratio(r["ratio"]), r["closest"], "; ".join(r["problems"]), r["config"]] for r in fails])
        payload["summary"] = {"fails": len(fails), "largest_ratio": max((r["ratio"] for r in rows if r["passed"]),
                                                                       default=None), "minutes": wall / 60}
    if args.sabotage:
        rows = sabotages()
        payload["sabotage"] = rows
        print_table(f"planted bugs: {len(rows)} checks run by the tests marked sabotage (ratio: the worst error over "
                    f"its tolerance; 'problem': a coverage, replica, initial-weight or routing problem)",
                    ["test", "verdict", "ratio", "worst", "test outcome"],
                    [[r["test"], "PASS" if r["passed"] else "FAIL", _ratio(r["ratio"]),
                      r["worst"] if r["ratio"] is not None else "; ".join(r["problems"])[:90], r["outcome"]]
                     for r in rows])
        fooled = [r for r in rows if r["passed"]]
        smallest = min((r["ratio"] for r in rows if r["ratio"] is not None), default=None)
        print(f"\n{len(rows) - len(fooled)} of {len(rows)} sabotaged checks FAIL; the smallest ratio of a sabotage: "
              f"{_ratio(smallest)}")
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
