"""Benchmark: resuming from a checkpoint is the uninterrupted run, bit for bit, at any
configuration. Fault tolerance rests on it (a restart after a crash must not change the
run: Megatron-LM's and torchtitan's resume-correctness tests compare the losses of a
resumed run with the uninterrupted one); the suite proves it on a dozen hand-picked layouts
(tests/test_checkpoint.py), this sweep off them.

Each configuration is one of benchmarks/check_sweep.py's random draws (the same draw for the
same seed and index: every axis and composition, ZeRO stages and hybrid sharding, uneven
stages, activation checkpointing, float64 to float16, dense and today's MoE with its
balancing bias), trained for at least two steps three ways: uninterrupted; stopped after a
random step k with a checkpoint written there (`--save`, as a user's run that a crash then
ended); resumed from it to the end (`--resume`). From step k on, the resumed run must give
the uninterrupted run's losses, every rank's reduced gradients, weights and AdamW moments,
each MoE layer's counts and balancing bias, the fp16 loss scale and AdamW's count, all to the
bit.

`--reshard` resumes in another layout instead, drawn at random for the same model, dtype and
global batch (any axes, ZeRO stage, schedule and stages). Moving a checkpoint between layouts
moves bytes: the weights, moments and buffers the resumed layout loads, made whole, must be
those the stopped one saved, to the bit, and AdamW's count the same; in float64 a dense model's resumed steps' losses must
then be the uninterrupted run's to the check's float64 loss tolerance (the layouts round
otherwise; an MoE model's token groups, and so its drops, change with the layout).

    python benchmarks/resume_sweep.py --configs 200                 # simulated ranks
    python benchmarks/resume_sweep.py --configs 20 --backend gloo   # one process a rank
    python benchmarks/resume_sweep.py --configs 200 --reshard       # resumed in another layout
"""
import argparse
import contextlib
import dataclasses
import io
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from benchmarks.check_sweep import MAX_WORLD, _stage_layers, describe, draw  # noqa: E402


def _same(a, b) -> bool:
    """Bit for bit, NaN where the other has NaN (an fp16 step that overflowed: its gradients
    hold NaN, and NaN is equal to nothing)."""
    import torch
    if not isinstance(a, torch.Tensor):
        return a == b or (a != a and b != b)
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and \
        torch.equal(torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b))


def differences(whole, resumed, k: int) -> list:
    """What the resumed run (from step k) does otherwise than the uninterrupted one, first
    differences first: [] when it is the same run, bit for bit."""
    out = []
    if resumed.start != k:
        out.append(f"resumed at step {resumed.start}, not {k}")
    for step, (a, b) in enumerate(zip(whole.losses[k:], resumed.losses), start=k):
        if not _same(a, b):
            out.append(f"step {step + 1}'s loss {a!r} against {b!r}")
    if len(resumed.losses) != len(whole.losses) - k:
        out.append(f"{len(resumed.losses)} steps resumed, not {len(whole.losses) - k}")
    moe_a, moe_b = whole.moe_steps()[k:], resumed.moe_steps()
    for step in range(k, len(whole.losses)):
        for rank, (a, b) in enumerate(zip(whole.values, resumed.values)):
            sa, sb = a["steps"][step], b["steps"][step - k]
            if sa["loss_scale"] != sb["loss_scale"] or sa["skipped"] != sb["skipped"]:
                out.append(f"step {step + 1}, rank {rank}: loss scale {sa['loss_scale']} against {sb['loss_scale']}")
            if sa["updates"] != sb["updates"]:
                out.append(f"step {step + 1}, rank {rank}: AdamW's count {sa['updates']} against {sb['updates']}")
            pairs = [("grad", pa, ta, pb, tb) for (pa, ta), (pb, tb) in zip(sa["grads"], sb["grads"])]
            pairs += [(kind, pa, ta, pb, tb) for (kind, pa, ta), (_, pb, tb) in zip(sa["state"], sb["state"])]
            if len(sa["grads"]) != len(sb["grads"]) or len(sa["state"]) != len(sb["state"]):
                out.append(f"step {step + 1}, rank {rank}: other pieces")
            for kind, pa, ta, pb, tb in pairs:
                if pa != pb or not _same(ta, tb):
                    out.append(f"step {step + 1}, rank {rank}: {kind} of {pa}")
                    break
        if step - k < len(moe_a) and step - k < len(moe_b):
            for layer, a in moe_a[step - k].items():
                b = moe_b[step - k].get(layer, {})
                for key in ("routed", "assignments", "dropped", "bias"):
                    x, y = a.get(key), b.get(key)
                    if not _same(x, y):
                        out.append(f"step {step + 1}, MoE layer {layer}: {key} {x} against {y}")
    return out


def other_layout(rng: random.Random, run):
    """Another layout for `run`'s model, dtype and global batch, drawn as check_sweep draws
    one (a run the configuration accepts), or None when 500 draws give none."""
    from playground import Layout, LayoutError
    m, batch = run.model, run.layout.global_batch
    for _ in range(500):
        tp, pp, cp = rng.choice((1, 1, 2, 2, 4)), rng.choice((1, 1, 2, 3)), rng.choice((1, 1, 2, 3))
        dp = rng.choice([d for d in range(1, batch + 1) if batch % d == 0])
        if dp * tp * pp * cp > MAX_WORLD:
            continue
        mbs = rng.choice([b for b in range(1, batch // dp + 1) if batch // dp % b == 0])
        schedule = rng.choice(("gpipe", "1f1b", "interleaved", "zb1")) if pp > 1 else "1f1b"
        v = rng.choice((2, 3)) if schedule == "interleaved" else 1
        zero = rng.choice((0, 1) if pp > 1 else (0, 1, 2, 3))
        experts = [e for e in range(1, dp * cp + 1) if dp * cp % e == 0 and m.n_experts % e == 0] if m.n_experts else [1]
        replicate = rng.choice([r for r in range(2, dp + 1) if dp % r == 0] or [1]) if zero and rng.random() < 0.3 else 1
        stages = _stage_layers(rng, m.n_layers, pp * v) if pp > 1 and rng.random() < 0.3 else None
        layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=rng.choice(experts), zero=zero, schedule=schedule,
                        microbatches=batch // (dp * mbs), virtual_stages=v, micro_batch_size=mbs,
                        sequence_parallel=tp > 1 and (bool(m.n_experts) or rng.random() < 0.5),
                        cp_impl=rng.choice(("ring", "ring", "ulysses")), cp_balance=rng.choice(("zigzag", "contiguous")),
                        dp_replicate=replicate, stage_layers=stages,
                        ac=rng.choice(("none", "none", "full", "selective", "selective-op")))
        if layout == run.layout:
            continue
        try:
            layout.validate(m)
            return dataclasses.replace(run, layout=layout)
        except (LayoutError, ValueError):
            continue
    return None


def _whole(per_rank: list, kind: str) -> dict:
    """The full tensors of `kind` ("param", "exp_avg", "exp_avg_sq", "buffer") from every rank's
    [(kind, Placement, tensor)]."""
    from model import assemble
    full, problems = assemble([[(pl, t) for k, pl, t in state if k == kind] for state in per_rank])
    return full if not problems else {"problems": problems[:2]}


def moved(saved, resumed) -> list:
    """How the state a resumed run loaded (every rank's, made whole) differs from what the
    stopped run saved at its last step: [] when every byte arrived."""
    out = [f"rank {rank}: AdamW's count {b['initial_updates']}, not {a}" for a in {v["steps"][-1]["updates"]
                                                                                  for v in saved.values}
           for rank, b in enumerate(resumed.values) if b["initial_updates"] != a]
    for kind in ("param", "exp_avg", "exp_avg_sq", "buffer"):
        a = _whole([v["steps"][-1]["state"] for v in saved.values], kind)
        b = _whole([v["initial"] for v in resumed.values], kind)
        if a.keys() != b.keys():
            out.append(f"{kind}: {sorted(set(a) ^ set(b))[:2]} on one side only")
        out += [f"{kind} of {name} loaded otherwise" for name in a if name in b and not _same(a[name], b[name])]
    return out


def one(index: int, seed: int, backend: str = "sim", reshard: bool = False) -> dict:
    """Draw configuration `index` of the sweep seeded `seed`, stop it at a random step with a
    checkpoint, resume it, and compare with the run that did not stop."""
    from playground import train
    run, _ = draw(random.Random(f"{seed}:{index}"))
    steps = run.steps + 1  # (at least 2: a step before the checkpoint and one after)
    k = random.Random(f"{seed}:{index}:stop").randint(1, steps - 1)
    run = dataclasses.replace(run, steps=steps, backend=backend)
    other = other_layout(random.Random(f"{seed}:{index}:layout"), run) if reshard else run
    row = {"index": index, "config": describe(run), "dtype": run.dtype, "moe": bool(run.model.n_experts),
           "world": run.layout.world, "steps": steps, "stopped_at": k}
    if other is None:
        return {**row, "same": None, "differences": [], "seconds": 0.0, "resumed_in": None}
    row["resumed_in"] = other.layout.describe() if reshard else None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        try:
            whole = train(run, collect=not reshard)
            with contextlib.redirect_stderr(io.StringIO()):  # (its "checkpoint: ... saved" line)
                saved = train(dataclasses.replace(run, steps=k, save=folder), collect=reshard)
            resumed = train(dataclasses.replace(other, resume=folder), collect=True)
        except Exception as e:  # noqa: BLE001 (a correct configuration whose resume raises fails the sweep)
            return {**row, "same": False, "seconds": time.perf_counter() - t0,
                    "differences": [f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]}
    found = moved(saved, resumed) + _losses_apart(whole, resumed, k) if reshard else differences(whole, resumed, k)
    return {**row, "same": not found, "differences": found[:4], "seconds": time.perf_counter() - t0}


def _losses_apart(whole, resumed, k: int) -> list:
    """In float64 on a dense model, the resumed steps' losses against the uninterrupted run's,
    at the check's float64 loss tolerance (playground/tolerance.py). In other dtypes the two
    layouts' rounding moves them too far to judge without the check's reference; and an MoE
    model computes another function in another layout: its capacity and its f_i are per token
    group, a rank's micro-batch (GShard), so the layouts drop and balance otherwise."""
    from playground.tolerance import tolerances
    if whole.run.dtype != "float64" or whole.run.model.n_experts:
        return []
    tol = tolerances("float64")["loss"]
    return [f"step {step + 1}'s loss {a!r} against {b!r}" for step, (a, b) in enumerate(zip(whole.losses[k:], resumed.losses),
                                                                                    start=k)
            if abs(a - b) > tol * abs(a)]


def _one_thread() -> None:
    """A worker process's torch runs on one thread (the workers share the cores)."""
    import torch
    torch.set_num_threads(1)


def sweep(n: int, seed: int, workers: int, backend: str, reshard: bool = False) -> list:
    out = []
    with ProcessPoolExecutor(max_workers=workers, initializer=_one_thread) as pool:
        for i, res in enumerate(pool.map(one, range(n), [seed] * n, [backend] * n, [reshard] * n)):
            out.append(res)
            if res["same"] is False:
                print(f"  configuration {res['index']} differs: {'; '.join(res['differences'])[:200]}", flush=True)
            if (i + 1) % 25 == 0 or i + 1 == n:
                print(f"  {i + 1}/{n} resumed, {sum(r['same'] is False for r in out)} differ", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=int, default=200, help="random configurations to stop and resume")
    ap.add_argument("--seed", type=int, default=0, help="the sweep's seed (configuration i is check_sweep's seed:i)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="configurations run at once (processes)")
    ap.add_argument("--backend", choices=("sim", "gloo"), default="sim",
                    help="where the layouts run: simulated ranks, or one gloo process a rank")
    ap.add_argument("--reshard", action="store_true", help="resume each in another layout, drawn at random")
    ap.add_argument("--json", default=None, help="where the JSON goes (default: resume_sweep[_reshard].json here)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = sweep(args.configs, args.seed, args.workers, args.backend, args.reshard)
    skipped = [r for r in rows if r["same"] is None]
    rows = [r for r in rows if r["same"] is not None]
    wall = time.perf_counter() - t0
    summary = []
    for label, pick in (("all", lambda r: True), ("float64", lambda r: r["dtype"] == "float64"),
                        ("float32", lambda r: r["dtype"] == "float32"),
                        ("bfloat16", lambda r: r["dtype"] == "bfloat16"),
                        ("float16", lambda r: r["dtype"] == "float16"), ("MoE", lambda r: r["moe"]),
                        ("world >= 6", lambda r: r["world"] >= 6)):
        sel = [r for r in rows if pick(r)]
        if sel:
            summary.append([label, len(sel), sum(not r["same"] for r in sel),
                            sum(any(d.startswith("raised") for d in r["differences"]) for r in sel)])
    where = (" on gloo" if args.backend == "gloo" else "") + (
        f"; {len(skipped)} with no other layout left out" if skipped else "")
    how = "in another layout drawn at random" if args.reshard else "in the same layout"
    print_table(f"resume sweep: {len(rows)} random configurations stopped at a random step and resumed {how} (seed "
                f"{args.seed}{where}), {wall / 60:.1f} min", ["configurations", "n", "not the same run", "raised"],
                summary)
    differ = [r for r in rows if not r["same"]]
    if differ:
        print_table("resumed runs that are not the uninterrupted run", ["stopped at", "first differences", "configuration",
                                                                         "resumed in"],
                    [[f"{r['stopped_at']} of {r['steps']}", "; ".join(r["differences"])[:160], r["config"],
                      r["resumed_in"] or "the same layout"] for r in differ])
    write_json(args.json or default_json("resume_sweep" + ("_reshard" if args.reshard else "")),
               {"configs": args.configs, "seed": args.seed, "backend": args.backend, "reshard": args.reshard,
                "rows": rows, "skipped": [r["index"] for r in skipped],
                "summary": {"differ": len(differ), "minutes": wall / 60}})


if __name__ == "__main__":
    main()
