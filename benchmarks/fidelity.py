"""Benchmark: how close `playground plan` comes to measured GPU steps, in time and memory.
For each train JSON that benchmarks/fidelity_gpu.sh wrote (the 350m and 1b presets, and
1b-moe, in bf16 under torchrun on 2× H200, with the model as it is now (fused RMSNorm,
RoPE without a cat); the committed runs are benchmarks/results/gpu/run13_kernels (1b one
GPU and both pipelines), run14_side_by_side (350m pipelines, measured again: they take the
place of run13's), run15_fidelity (the rest) and run16_host (1b one GPU, TP 2, TP 2 + SP,
CP 2, 350m DDP and TP 2, 1b-moe EP 2, measured again in the call and on the machine that
`playground calibrate` fitted the shipped `h200` profile on: they take the place of the
earlier runs), run19_unfused (one H200: 1b and 350m on one GPU with attention="unfused",
Megatron-LM's of 2021, and the flash kernel again beside it), run20_dropout (one H200: 1b and
350m with attention dropout 0.1 on the unfused attention, beside it without, measured again:
they take the place of run19's; and 1b with it under full checkpointing), run22_zero3_w1 (one
H200: 1b and 350m under ZeRO-3 at dp 1, measured after the engine stopped keeping a bf16
parameter shard and its gradient shards through the forward; the 2-GPU ZeRO-3 runs of
run15 measured the engine before that and are listed, not compared: `SUPERSEDED`),
run26_zero_units (the same two again, after the embedding and the head became ZeRO units of
their own: they take the place of run22's), run27_one_gpu (one H200, after the initialisation
on threads and the batches from a DataLoader worker: 1b and 350m on one GPU and under ZeRO-3
at dp 1 again, taking the place of the earlier ones; and 1b under each activation
checkpointing mode at micro-batch 4 and at the largest the plan fits), run28_before_after
(selective checkpointing at 32) and run30_expandable (the two that ran out of memory in run27,
with torch's expandable segments)), run34_moe_fidelity (one H200: 1b-moe and 1b-dsmoe with
the MoE layer's regions compiled) and run40_moe_fidelity (the same two again, the layer one
compiled region with one sort: they take the place of run34's; 1b-moe twice) and run42_host_medians
(one H200: the host-bound one-GPU rows, 350m, 1b-moe, 1b-dsmoe and 1b with selective
checkpointing at micro-batch 4, three runs each, alternated: they take the place of the
earlier ones) and run46_master_adamw (one H200: 1b-moe and its dense model, three alternated
runs each with ZeRO's one-pass step with compute copies, `after`, and with the separate passes
before it, `before`, each planned as it stepped) and run48_moe_graphs_rounds (one H200: 1b-moe as
compiled regions, `moe_after`, with --cuda-graphs, `graphs`, planned without them: a plan
prices no graph replay, and its dense model, `dense_after`, three alternated rounds, taking
the place of run46's runs of those names, after ZeRO's gradients
were copied into its flat buffer instead of zeroed and added; the earlier rows ran the
latter and are planned as the code is now: about 1% shorter) and run49_grad_dtype (one H200:
1b with its gradients in bf16 and in float32, `--grad-dtype float32`, two alternated rounds;
a Llama-3-shaped 3B without and with full recomputation: `3b_single`, `3b-acfull_single`) and
run55_one_gpu_rows (one H200, after collectives over one rank stopped going through NCCL: 350m,
1b-moe as compiled regions and graphed, its dense model, three or two alternated rounds, and
350m under ZeRO-3 at dp 1, taking the place of the earlier runs of those names; the other
one-GPU rows measured the code before, whose buckets each cost an NCCL call the plans no
longer price) and run64_bf16_default (one H200, after bf16 without ZeRO became compute copies by
default: 1b-moe as typed, `typed`, graphed, `graphs`, and its dense model, `dense`, three
alternated rounds each, taking the place of run55's `graphs`; its `autocast` rows ran
`--autocast`, which no plan prices, and are left out) and run68_moe_ties (one H200, after each token's
experts became a stable sort instead of torch.topk: 1b-moe and 1b-dsmoe, three alternated
rounds each, taking the place of run42's `1b-moe_1gpu` and `1b-dsmoe_1gpu`; its torch.topk
runs, `old_topk_`, are not compared),
plans the same model and layout on that profile (simulator/profiles/h200.json)
and prints, per layout: the measured median step (steps after the first; a layout run again
in the same call, named `_2`, `_3` after it, the median of its runs' medians: a host-bound
step varies from run to run by more than one run's steps do) against the planned step, and
the measured CUDA peak (`torch.cuda.max_memory_allocated`, the largest over the ranks)
against the planned peak, with the relative error of each; and the
planned step's split into compute, host (the device waiting for the host to issue
kernels: the compute model's two queues), exposed communication and idle. And the host's
own time per step: measured (from run16 on: the step's wall time less the time the host
waited for the device in the torch backend's run-ahead bound, `host_blocked_s`; one-GPU runs
from run55 on wait in no bound, so there it is the whole step; later runs also count the NaN
check's read of its flags) against
planned (the floors of the ops and calls it issued: `issuing`): where they agree and
the step is still off, the device side is. Writes JSON.

The pipeline rows (run13, run14) measured the executor before it freed each sent output at
its gradient's return and each sent gradient at a later receive, and before split
backward's W freed its inputs: their peaks hold what
that code kept (per rank: benchmarks/memory_audit.py), and the peak compared here is the
largest over the ranks, which those changes move little (the ZB-H1 first stage they move by
about 0.9 GiB is not the largest).

The measured runs without ZeRO use `--bf16-copies` (bf16 compute copies with fp32 master
weights), the mixed precision a plan prices; with ZeRO that is ZeRO's own.
"""
import argparse
import os
import re
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402
from benchmarks.gpu_runs import step_times, train_jsons  # noqa: E402
from collectives.ledger import human_bytes  # noqa: E402
from model import GPTConfig  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402

GPU = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu")
MEASURED = [os.path.join(GPU, name) for name in ("run13_kernels", "run14_side_by_side", "run15_fidelity",
                                                  "run16_host", "run19_unfused", "run20_dropout", "run22_zero3_w1", "run26_zero_units",
                                                  "run27_one_gpu", "run28_before_after", "run30_expandable",
                                                  "run34_moe_fidelity", "run40_moe_fidelity", "run42_host_medians",
                                                  "run46_master_adamw", "run48_moe_graphs_rounds",
                                                  "run49_grad_dtype", "run55_one_gpu_rows", "run64_bf16_default",
                                                  "run68_moe_ties")]
# runs of code that has changed since: a plan prices the code as it is, so these are not compared
SUPERSEDED = {
    "1b_zero3": "ZeRO-3 then kept a bf16 parameter shard and its gradient shards through the forward (4Ψ/N more)",
    "350m_zero3": "ZeRO-3 then kept a bf16 parameter shard and its gradient shards through the forward (4Ψ/N more)",
    "1b-moe_ep2": "the experts then ran as a Python loop with host reads of the counts at every layer; a plan now "
                  "prices the grouped GEMMs they run as (benchmarks/results/gpu/run32_moe_speed)",
}


def measured_run(m: dict) -> RunConfig:
    """The RunConfig of a train JSON: its model, layout and dtype, and how its ZeRO engine
    stepped with compute copies (runs before the one-pass step recorded nothing: separate
    passes, `RunConfig.fused_master_step`)."""
    model = GPTConfig(**{k: v for k, v in m["model"].items() if k != "n_params"})
    layout = Layout(**{k: v for k, v in m["layout"].items() if k not in ("world", "global_batch")})
    return RunConfig(model=model, layout=layout, dtype=m["run"]["dtype"], progress=False,
                     fused_master_step=m["run"].get("fused_master_step", False),
                     grad_dtype=m["run"].get("grad_dtype"), bf16_copies=m["run"].get("bf16_copies", False))


def layout_name(name: str) -> str:
    """The layout a run's name measures: a repeat of a run in the same call is named with
    `_2`, `_3`, ... after it (`1b-moe_1gpu_2`)."""
    return re.sub(r"_\d+$", "", name)


def latest_runs(folders: list) -> dict:
    """{layout name: (folder, [train JSONs])}: each layout's runs from the last of `folders`
    that measured it (all of that folder's repeats of it, none of an earlier folder's)."""
    out: dict = {}
    for d in folders:
        here: dict = {}
        for name, m in train_jsons(d):
            # (side-by-side runs; runs under --autocast, a recipe no plan prices; runs under a profiler)
            if not name.startswith(("pg_", "old_")) and not name.endswith("_profiled") and not m["run"].get("autocast"):
                here.setdefault(layout_name(name), []).append(m)
        out.update({k: (d, ms) for k, ms in here.items()})
    return out


def compare(name: str, folder: str, ms: list, hardware: str) -> dict:
    """Plan the layout of the train JSONs `ms` (`name`, measured in the run `folder`: one run,
    or repeats of it in one call, alternated with others) on `hardware`. The measured step is
    a run's median step (steps after the first), the median of those over the repeats: a
    host-bound step varies from run to run by more than any one run's steps do."""
    run = measured_run(ms[0])
    steps = [median(step_times(m["throughput"])[1:]) for m in ms]
    measured = median(steps)
    p = plan(RunConfig(**{**run.__dict__, "hardware": hardware}))
    slowest = max(p.values, key=lambda v: v["step"]["time"])["step"]
    own = []
    for m in ms:
        blocked = m["throughput"].get("host_blocked_s")  # (runs before run16 did not record it)
        if blocked:
            own.append(median([t - b for t, b in zip(m["throughput"]["step_times_s"][1:], blocked[1:])]))
    cuda_peak = max(r.get("cuda_peak_allocated", 0) for m in ms for r in m["memory"])
    planned_peak = p.peak
    return {"layout": name, "measured_in": os.path.basename(os.path.normpath(folder)), "runs": len(ms),
            "measured_steps_s": steps, "describe": run.layout.describe(), "measured_step_s": measured,
            "planned_step_s": p.step_s, "step_error": p.step_s / measured - 1, "planned": slowest,
            "measured_host_own_s": median(own) if own else None,
            "measured_cuda_peak": cuda_peak, "planned_peak": planned_peak,
            "memory_error": planned_peak / cuda_peak - 1 if cuda_peak else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", nargs="+", default=MEASURED,
                    help="folders of train JSONs from fidelity_gpu.sh (a run in a later one replaces the same-named)")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--json", default=default_json("fidelity"))
    a = ap.parse_args()
    runs = latest_runs(a.measured)
    stale = {k: runs.pop(k) for k in sorted(runs) if k in SUPERSEDED}
    rows = [compare(k, *runs[k], a.hardware) for k in sorted(runs)]
    if not rows:
        sys.exit(f"fidelity: no train JSON in {a.measured}")
    within = sum(abs(r["step_error"]) <= 0.10 for r in rows), sum(
        r["memory_error"] is not None and abs(r["memory_error"]) <= 0.10 for r in rows)
    print_table(f"bf16 on one and two H200s: planned on {a.hardware} against measured (median step; CUDA peak allocated); "
                f"within 10%: step {within[0]}/{len(rows)}, memory {within[1]}/{len(rows)}",
                ["run", "measured in", "measured step", "planned step", "error", "compute", "host", "exposed comm", "idle",
                 "host's own: measured", "planned", "CUDA peak", "planned peak", "error"],
                [[r["layout"], r["measured_in"] + (f" ({r['runs']} runs)" if r["runs"] > 1 else ""),
                  f"{r['measured_step_s'] * 1e3:.1f} ms" + (
                      f" ({min(r['measured_steps_s']) * 1e3:.1f}-{max(r['measured_steps_s']) * 1e3:.1f})"
                      if r["runs"] > 1 else ""),
                  f"{r['planned_step_s'] * 1e3:.1f} ms",
                  f"{r['step_error']:+.0%}", f"{r['planned']['compute'] * 1e3:.1f} ms",
                  f"{r['planned']['host'] * 1e3:.1f} ms",
                  f"{r['planned']['exposed_comm'] * 1e3:.1f} ms", f"{r['planned']['idle'] * 1e3:.1f} ms",
                  f"{r['measured_host_own_s'] * 1e3:.1f} ms" if r["measured_host_own_s"] is not None else "-",
                  f"{r['planned']['issuing'] * 1e3:.1f} ms",
                  human_bytes(r["measured_cuda_peak"]), human_bytes(r["planned_peak"]),
                  f"{r['memory_error']:+.0%}" if r["memory_error"] is not None else "-"] for r in rows])
    for k, (folder, _) in stale.items():
        print(f"not compared: {k} ({os.path.basename(os.path.normpath(folder))}): {SUPERSEDED[k]}")
    write_json(a.json, {"benchmark": "fidelity", "hardware": a.hardware, "measured_from": [os.path.relpath(d) for d in a.measured],
                        "within_10pct": {"step": within[0], "memory": within[1], "rows": len(rows)}, "rows": rows,
                        "superseded": {k: SUPERSEDED[k] for k in stale}})


if __name__ == "__main__":
    main()
