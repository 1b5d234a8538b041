"""`playground plan`: what a layout would cost on a hardware profile, from the real
per-rank program on meta tensors (shapes only: parameters, activations, collectives).

Every rank builds its part of the model through `parallelize` on the meta device and runs
two training steps, optimizer included (AdamW makes its moments at the first, which runs
the fewest microbatches the schedule allows and is not counted; the second is the one
reported), under the simulator's clock and memory accounting. bfloat16 is
planned with bf16 compute copies and fp32 master weights and moments (ZeRO's engine, at
stage 0 without --zero), as mixed-precision training keeps them on GPUs; autocast does not
exist on meta. Attention is priced as the flash kernel a GPU runs (docs/architecture.md,
"The simulator behind the process groups"); experts assume balanced routing.

Scale: the ranks of one pipeline stage run identical programs (the same shapes and group
sizes: tensor-, context-, data- and expert-parallel positions differ only in which slice of
the data or of the weights they hold), so by default one rank per stage runs, a stand-in
for its class; a collective within a class completes at once, costed for the whole group
(collectives/sim_world.py, "stand-ins"). `every_rank=True` runs them all; a test holds the
two equal.

Reported: the step split into compute, exposed communication and idle (waiting for peers:
a pipeline's bubble shows here) for each class of ranks with identical figures, tokens/s
and MFU (model FLOPs per token × tokens/s over world × peak bf16), memory by category per
class against the profile's HBM with the overshoot of any that would not fit (and `tight`
where a peak leaves less of it free than the allocator's headroom: playground/fits.py), and
the bytes each rank moves per step by label.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from collectives import launch
from collectives.ledger import human_bytes
from moe import expert_mesh_axes
from pipeline import fewest_microbatches
from simulator import SimulatedTime, load_hardware

from .fits import DEFAULT_HEADROOM, fits, verdict
from .rank_program import RankProgram
from .report import MEMORY_AT_PEAK, _rank_ranges, bytes_per_step, links_table, memory_at_peak, table


def planned_steps(world, run):
    """One rank's two steps on the meta device, as a plan runs them: the first makes AdamW's
    moments (its ops are not counted), the second is the one measured. Yields the rank's
    program three times in the second step: at its start, after its forward and backward,
    and at its end (after the optimizer), each inside the step (playground/memory_audit.py
    reads the second, `plan_rank` the first and the last)."""
    layout = run.layout
    dtype = torch.float32 if run.dtype in ("bfloat16", "float16") else run.param_dtype
    rank = RankProgram(world, run, "meta", dtype=dtype)
    batch = torch.empty(layout.global_batch, run.model.seq_len + 1, dtype=torch.long, device="meta")
    micro = rank.microbatches(rank.local(batch))
    compute = world.timing.compute_model
    fewest = fewest_microbatches(layout.schedule, layout.pp) if layout.pp > 1 else 1
    for step in range(2):
        with compute.paused() if step == 0 else compute.step():  # (a step starts with host and device in step)
            if step == 1:
                yield rank
            total = rank.forward_backward(micro[:fewest] if step == 0 else micro)
            if step == 1:
                yield rank
            rank.nonfinite(total)  # as a training step does
            rank.update()
            rank.average_loss(total)  # as a training step does
            if step == 1:
                yield rank


def plan_rank(world, run) -> dict:
    """One rank's plan: the second of `planned_steps`, timed, and its memory tracked."""
    clock = world.timing.clock
    steps = planned_steps(world, run)
    rank = next(steps)
    before = clock.breakdown()
    next(steps)
    next(steps)
    after = clock.breakdown()
    for _ in steps:  # (closes the step)
        pass
    return {"step": {k: after[k] - before[k] for k in after}, "memory": rank.memory_snapshot()}


@dataclass
class Plan:
    run: object
    values: list  # per rank: {"step": {...}, "memory": {...}}
    ledger: object
    wall_s: float
    clocks: list  # every rank's RankClock (only those that ran have advanced)
    ran: list  # the ranks that ran

    @property
    def by_classes(self) -> bool:
        """Whether stand-ins ran, each for the ranks of its pipeline stage."""
        return len(self.ran) < self.run.layout.world

    @property
    def step_s(self) -> float:
        return max(v["step"]["time"] for v in self.values)

    @property
    def peak(self) -> int:
        """The largest peak total memory over the ranks (bytes)."""
        return max(v["memory"]["peak_total"] for v in self.values)

    @property
    def tokens_per_s(self) -> float:
        return self.run.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.run.model.mfu(self.tokens_per_s, self.run.layout.world,
                                  load_hardware(self.run.hardware).peak_bf16_flops)


def stand_ins(layout) -> dict:
    """{rank: the rank that stands for it}: the rank of its pipeline stage at dp = cp = tp = 0."""
    inner = layout.dp * layout.cp * layout.tp
    return {r: (r // inner) * inner for r in range(layout.world)}


def _group_placements(shape: dict, axes, gpus_per_node: int) -> np.ndarray:
    """For every rank of a mesh of `shape`, the placement of its group along `axes`
    (simulator/cost_model.py, "placement": nodes spanned, ranks per node, every node holding
    as many) as three columns; computed once per group, so a world of 10^5 ranks takes
    milliseconds."""
    names = list(shape)
    world = int(np.prod([shape[n] for n in names]))
    size = int(np.prod([shape[n] for n in names if n in axes]))
    order = [i for i, n in enumerate(names) if n not in axes] + [i for i, n in enumerate(names) if n in axes]
    groups = np.arange(world).reshape([shape[n] for n in names]).transpose(order).reshape(-1, size)
    nodes = np.sort(groups // gpus_per_node, axis=1)
    first = np.ones_like(nodes, dtype=bool)
    first[:, 1:] = nodes[:, 1:] != nodes[:, :-1]
    runs = np.flatnonzero(first.ravel())  # where each node's run of ranks starts (every row starts one)
    lengths = np.diff(np.append(runs, nodes.size))
    starts = np.searchsorted(runs, np.arange(len(groups)) * size)
    most, least = np.maximum.reduceat(lengths, starts), np.minimum.reduceat(lengths, starts)
    spanned = np.diff(np.append(starts, len(runs)))
    out = np.empty((world, 3), dtype=np.int64)
    out[groups] = np.stack([spanned, most, most == least], axis=1)[:, None, :]
    return out


def placement_signatures(layout, gpus_per_node: int) -> np.ndarray:
    """What the time model sees of each rank's position, one row per rank: for each group the
    layout makes (mesh.group of these axes, the expert mesh's groups) the nodes it spans and
    its ranks per node, and whether its pipeline neighbours share its node. Ranks of a stage
    with equal rows time every call alike."""
    shape, eshape = layout.mesh_axes(), expert_mesh_axes(layout)
    cols = [_group_placements(shape, axes, gpus_per_node)
            for axes in (("dp",), ("tp",), ("cp",), ("pp",), ("dp", "cp"), ("dp", "cp", "tp"))]
    cols += [_group_placements(eshape, axes, gpus_per_node) for axes in (("ep",), ("edp", "tp"))]
    if layout.dp_replicate > 1:  # hybrid sharding's shard and replicate groups
        fine = {k: v for axis, size in shape.items() for k, v in layout.mesh_split().get(axis, {axis: size}).items()}
        cols += [_group_placements(fine, axes, gpus_per_node) for axes in (("dp_shard", "cp"), ("dp_replicate",))]
    rank = np.arange(layout.world)
    stride = layout.dp * layout.cp * layout.tp
    cols += [((rank + d * stride) % layout.world // gpus_per_node == rank // gpus_per_node)[:, None]
             for d in (-1, 1)]
    return np.concatenate(cols, axis=1)


def uniform_stages(layout, gpus_per_node: int) -> bool:
    """Whether every rank's placement signature equals its stand-in's: then the stand-ins
    time exactly what every rank would."""
    sig = placement_signatures(layout, gpus_per_node)
    inner = layout.dp * layout.cp * layout.tp
    return bool((sig == sig[np.arange(layout.world) // inner * inner]).all())


def planned_run(run):
    """`run` as a plan runs it: its layout validated (a clear error for one that does not
    fit), bf16 as compute copies of fp32 masters (what `precision` says a plan prices)."""
    run.layout.validate(run.model)
    if run.dtype == "bfloat16" and not run.layout.zero:
        run = replace(run, bf16_copies=True)
    return run


def plan(run, every_rank: bool = False) -> Plan:
    """Plan `run` (its hardware profile required) on simulated ranks: one per class of
    identical ranks, or `every_rank`."""
    if not run.hardware:
        raise ValueError("plan needs --hardware: the profile the layout is planned on")
    run = planned_run(run)
    t0 = time.perf_counter()
    of = stand_ins(run.layout)
    by_classes = not every_rank and uniform_stages(run.layout, load_hardware(run.hardware).gpus_per_node)
    live = sorted(set(of.values())) if by_classes else None
    time_model = SimulatedTime(run.hardware)
    # one rank at a time: ops on meta tensors hold the GIL, so more running rank threads only
    # contend for it (the 70b plan of benchmarks/plan_scale.py: 36 s, against 59 s with four)
    res = launch(plan_rank, run.layout.world, args=(run,), time_model=time_model, max_running=1, live=live)
    values, ledger = res.values, res.ledger
    if live is not None:  # every rank reports what its stand-in measured
        values = [values[of[r]] for r in range(run.layout.world)]
        ledger.per_rank = [ledger.per_rank[of[r]] for r in range(run.layout.world)]
    return Plan(run, values, ledger, time.perf_counter() - t0, time_model.clocks, live or list(range(run.layout.world)))


def _classes(rows: list) -> list:
    """[(ranks, row)]: ranks whose rows are equal share one."""
    out: dict = {}
    for r, row in enumerate(rows):
        out.setdefault(tuple(row), []).append(r)
    return sorted(((ranks, list(row)) for row, ranks in out.items()), key=lambda x: x[0][0])


def host_bound_note(p: Plan, hw, share: float = 0.05) -> str:
    """A line saying that the plan's step hangs on the host's speed, where the rank whose device
    waits longest for the host to issue kernels waits over `share` of its step: the host's
    time is its ops at the profile's `kernel_floor`, one host's speed, where the same program
    on one machine has issued twice as fast from one run to the next (the README's plans
    against our own GPU runs: 350m's step moved from 62 to 108 ms, the device's own time not
    at all). Empty otherwise."""
    rank = max(range(len(p.values)), key=lambda r: p.values[r]["step"]["host"])
    step = p.values[rank]["step"]
    if step["host"] <= share * step["time"]:
        return ""
    return (f"host-bound (rank {rank}): the device waits {step['host'] * 1e3:.2f} ms for the host, which issues its "
            f"ops for {step['issuing'] * 1e3:.1f} ms at {hw.kernel_floor * 1e6:.0f} µs each ({p.run.hardware}'s "
            f"kernel_floor: one host's speed, and a host's speed moves between runs) against "
            f"{step['compute'] * 1e3:.1f} ms of device compute: on a faster host the step shortens toward the "
            f"compute's, and CUDA graphs or compiled regions issue fewer ops")


def precision(run) -> tuple:
    """(the plan's dtype as the header says it, a line for the recipe it does not price or
    None). bf16 is priced as compute copies of fp32 masters (ZeRO's, or stage 0's: what
    `train --dtype bfloat16` runs), not as `train --autocast`: its casts of every weight
    in each forward and of the gradients back, not priced, added 9 to 12 ms of device time to
    a 1b-scale step on an H200 (README, "Mixture of experts")."""
    if run.dtype != "bfloat16":
        return run.dtype, None
    if run.layout.zero:
        return "bfloat16 (ZeRO's bf16 compute copies of fp32 masters)", None
    return "bfloat16 (bf16 compute copies of fp32 masters, as train runs it)", (
        "(`train --autocast` runs under torch.autocast instead, whose casts of the weights each step this plan does "
        "not price)")


def summary(p: Plan, headroom: float = DEFAULT_HEADROOM) -> str:
    run, cfg, layout = p.run, p.run.model, p.run.layout
    hw = load_hardware(run.hardware)
    dtype, unpriced = precision(run)
    lines = [f"\nplayground plan: {layout.describe()}, model {cfg.n_params():,} parameters (d_model {cfg.d_model}, "
             f"{cfg.n_layers} layers, {cfg.n_heads} heads), {dtype}, on {run.hardware}",
             f"global batch: {layout.global_batch} sequences × {cfg.seq_len} tokens = {run.tokens_per_step:,} tokens/step "
             f"(dp {layout.dp} × {layout.microbatches} microbatches × {layout.micro_batch_size} sequences)",
             f"step {p.step_s * 1e3:.1f} ms: {p.tokens_per_s:,.0f} tokens/s, MFU {100 * p.mfu:.1f}% "
             f"({cfg.flops_per_token():,} model FLOPs per token; planned in {p.wall_s:.1f} s, "
             + (f"one rank per pipeline stage standing for its {layout.world // layout.pp})" if p.by_classes else
                "every rank run)" if uniform_stages(layout, hw.gpus_per_node) else
                "every rank run: the ranks of a stage sit differently across nodes)")]
    if unpriced:
        lines.append(unpriced)
    if layout.ac in ("selective", "selective-op") and hw.selective_floor is None:
        lines.append(f"(--ac {layout.ac}: what selective checkpointing's dispatch mode costs the host per op, "
                     f"not measured on {run.hardware}, is not priced; a host-bound step can run slower than under "
                     f"full recomputation: `playground calibrate` measures it)")
    if cfg.n_experts and hw.region_op_floor is None:
        lines.append(f"(the MoE layer's compiled regions: each call priced one kernel floor, their cost per op "
                     f"not measured on {run.hardware}; a host-bound step can run slower: `playground calibrate` "
                     f"measures it)")
    pipeline = layout.pp > 1
    rows = [[f"{v['step']['time'] * 1e3:.2f} ms", f"{v['step']['compute'] * 1e3:.2f} ms",
             f"{v['step']['host'] * 1e3:.2f} ms", f"{v['step']['exposed_comm'] * 1e3:.2f} ms", f"{v['step']['idle'] * 1e3:.2f} ms"]
            + ([f"{v['step']['bubble'] * 1e3:.2f} ms"] if pipeline else []) for v in p.values]
    lines.append("\nthe step per class of ranks (host: the device waiting for the host to issue kernels; idle: "
                 "waiting for peers, a pipeline's bubble included):")
    header = ["ranks", "step", "compute", "host", "exposed comm", "idle"] + (["of it pipeline bubble"] if pipeline else [])
    lines.append(table(header, [[_rank_ranges(r), *row] for r, row in _classes(rows)], left=1))
    note = host_bound_note(p, hw)
    if note:
        lines.append(note)
    cap = hw.hbm_capacity
    rows = []
    for v in p.values:
        m = v["memory"]
        rows.append([*(human_bytes(x) for x in memory_at_peak(m).values()),
                     human_bytes(m["peak_total"]), f"{100 * m['peak_total'] / cap:.1f}%",
                     verdict(m["peak_total"], hw, headroom)])
    lines.append(f"\nmemory per class of ranks at the peak (by category: the parts sum to it; {human_bytes(cap)} of "
                 f"HBM on {run.hardware}, of which {100 * (1 - headroom):.0f}% fits: the rest is the caching "
                 f"allocator's and the CUDA context's, --memory-headroom):")
    lines.append(table(["ranks", *MEMORY_AT_PEAK.values(), "peak total", "of HBM", ""],
                       [[_rank_ranges(r), *row] for r, row in _classes(rows)], left=1))
    lines.append("\ncommunication per rank per step (planned):")
    lines.append(bytes_per_step(p.ledger, 2))
    if layout.world > 1:
        lines.append(links_table(p.ledger, 2, run.hardware))
    return "\n".join(lines)


def failures_summary(p: Plan, gbps: float, mtbf_hours: float | None, restart_s: float) -> str:
    """The checkpoint's cost and, with a failure rate, the interval of the most goodput
    (playground/goodput.py)."""
    from .goodput import failure_plan
    f = failure_plan(p.run.model, p.run.layout, p.step_s, gbps, mtbf_hours, restart_s)
    text = (f"\ncheckpoint: {human_bytes(f.bytes_per_rank)} written by the busiest rank (fp32 weights and AdamW's "
            f"moments), {f.write_s:.2f} s at {gbps:g} GB/s per rank (--checkpoint-gbps)")
    if f.mtbf_s is None:
        return text + "; --mtbf-hours H gives the checkpoint interval of the most goodput"
    return text + (f"\nfailures: one every {f.mtbf_s / 3600:.2f} h for the job ({mtbf_hours:g} h per GPU over "
                   f"{p.run.layout.world} GPUs), a restart costing {f.restart_s:.0f} s: checkpoint every "
                   f"{f.interval_steps:,} steps ({f.interval_s / 60:.1f} min, Daly 2006), expected goodput "
                   f"{100 * f.goodput:.1f}% (every step: {100 * f.goodput_every_step:.1f}%)")


def plan_json(p: Plan, headroom: float = DEFAULT_HEADROOM) -> dict:
    from .summary import SCHEMA_VERSION, _run_json, communication
    hw = load_hardware(p.run.hardware)
    return {"schema": f"playground.plan/{SCHEMA_VERSION}", **_run_json(p.run), "step_s": p.step_s,
            "tokens_per_s": p.tokens_per_s, "mfu": p.mfu, "hbm": hw.hbm_capacity, "memory_headroom": headroom,
            "wall_s": p.wall_s,
            "by_classes": p.by_classes,
            "per_rank": [{"rank": r, **{f"{k}_s": x for k, x in v["step"].items()}, "memory": v["memory"],
                          "fits": fits(v["memory"]["peak_total"], hw, headroom)} for r, v in enumerate(p.values)],
            "communication": communication(p.ledger, 2)}
