"""`playground plan --search`: every layout of a world and a global batch, planned, and the
fastest that fit memory, in the spirit of the layout sweeps of Narayanan et al. 2021
(section 3: tensor parallelism inside a node, pipeline stages across nodes, data
parallelism over the rest, the micro-batch size traded against the bubble).

Candidates (`candidates`): tp among the divisors of the world up to the GPUs of a node
(dividing the heads, key/value heads and d_ff), with sequence parallelism whenever tp > 1;
pp among the divisors that divide the layers; cp > 1 only for sequences of 8192 tokens or
more (shorter ones gain nothing from splitting attention); dp the rest; ep, for a model
with experts, the largest divisor of dp·cp that divides the experts; micro-batch sizes 1,
2, 4 and 8 that divide each replica's share of the batch; ZeRO-1 and ZeRO-3 without a
pipeline (ZeRO-0 holds more than ZeRO-1 for the same traffic; ZeRO-2 lies between), ZeRO-1
with one (ZeRO-2/3 are refused there); 1F1B and, where the layers and microbatches allow,
interleaved 1F1B with two chunks per rank; activation checkpointing none, selective and
full. Axes the caller fixes (`fixed`) are not searched.

Each candidate is first held to `Layout.validate` and to a lower bound of its memory (the
model states alone: bf16 weights and gradients, fp32 master weights and moments, split by
tp·pp and sharded by ZeRO over dp·cp); the survivors are planned (`planning.plan`), and a
plan whose peak exceeds the profile's HBM is rejected with its peak. Checkpointing modes
are tried in the order none, selective, full, and a layout that fits with one is not
planned with the next: recomputation only adds time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from simulator import load_hardware

from .layout import Layout, LayoutError, divisors
from .planning import plan


def candidates(cfg, world: int, global_batch: int, gpus_per_node: int, fixed: dict | None = None) -> list:
    """Every layout the search considers, before validation."""
    fixed = fixed or {}

    def options(name, values):
        return [fixed[name]] if fixed.get(name) is not None else values
    out = []
    for tp in options("tp", [d for d in divisors(world) if d <= gpus_per_node]):
        for pp in options("pp", [d for d in divisors(world // tp) if cfg.n_layers % d == 0]):
            for cp in options("cp", [d for d in divisors(world // (tp * pp)) if d == 1 or cfg.seq_len >= 8192]):
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                if global_batch % dp:
                    continue
                ep = options("ep", [max((d for d in divisors(dp * cp) if cfg.n_experts % d == 0), default=1)
                                    if cfg.n_experts else 1])[0]
                for mbs in options("micro_batch_size", [b for b in (1, 2, 4, 8) if (global_batch // dp) % b == 0]):
                    m = global_batch // dp // mbs
                    for zero in options("zero", [1] if pp > 1 else [1, 3]):
                        schedules = [("1f1b", 1)]
                        if pp > 1 and cfg.n_layers % (2 * pp) == 0 and m % pp == 0:
                            schedules.append(("interleaved", 2))
                        for schedule, v in schedules if pp > 1 else [("1f1b", 1)]:
                            for ac in options("ac", ["none", "selective", "full"]):
                                out.append(Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, schedule=schedule,
                                                  microbatches=m, virtual_stages=v, sequence_parallel=tp > 1,
                                                  micro_batch_size=mbs, ac=ac))
    return out


def model_states_bound(cfg, layout: Layout) -> float:
    """Bytes of model states per rank, a lower bound of its peak: bf16 weights and
    gradients (2 + 2 bytes) and fp32 master weights and AdamW moments (12 bytes) per
    parameter, each rank holding 1/(tp·pp) of the parameters, ZeRO sharding the 12 bytes
    (stage 1), the gradients too (2) and the weights too (3) over dp·cp."""
    psi = cfg.n_params() / (layout.tp * layout.pp)
    n = layout.dp * layout.cp
    weights, grads, states = 2 * psi, 2 * psi, 12 * psi / (n if layout.zero >= 1 else 1)
    if layout.zero >= 2:
        grads /= n
    if layout.zero >= 3:
        weights /= n
    return weights + grads + states


@dataclass
class SearchResult:
    fits: list = field(default_factory=list)  # (Plan, layout), fastest first
    rejected: list = field(default_factory=list)  # (layout, kind, reason)
    considered: int = 0
    planned: int = 0
    wall_s: float = 0.0


def search(run, world: int, global_batch: int, fixed: dict | None = None) -> SearchResult:
    """Plan every candidate layout of `run` (its model, dtype and hardware) on `world` ranks
    with `global_batch` sequences per step."""
    t0 = time.perf_counter()
    hw = load_hardware(run.hardware)
    res = SearchResult()
    fitted: set = set()  # layouts (without their checkpointing) that fit with less recomputation
    for layout in candidates(run.model, world, global_batch, hw.gpus_per_node, fixed):
        res.considered += 1
        if replace(layout, ac="none") in fitted:
            res.rejected.append((layout, "dominated", f"ac={layout.ac} not planned: the same layout fits with less "
                                 f"recomputation, which only adds time"))
            continue
        try:
            layout.validate(run.model)
        except LayoutError as e:
            res.rejected.append((layout, "invalid layout", str(e)))
            continue
        bound = model_states_bound(run.model, layout)
        if bound > hw.hbm_capacity:
            res.rejected.append((layout, "model states exceed HBM", f"model states alone {bound / 2**30:.1f} GiB > "
                                 f"{hw.hbm_capacity / 2**30:.1f} GiB of HBM"))
            continue
        p = plan(replace(run, layout=layout))
        res.planned += 1
        peak = max(v["memory"]["peak_total"] for v in p.values)
        if peak > hw.hbm_capacity:
            res.rejected.append((layout, "planned peak exceeds HBM", f"planned peak {peak / 2**30:.1f} GiB > "
                                 f"{hw.hbm_capacity / 2**30:.1f} GiB of HBM"))
            continue
        res.fits.append((p, layout))
        fitted.add(replace(layout, ac="none"))
    res.fits.sort(key=lambda x: x[0].step_s)
    res.wall_s = time.perf_counter() - t0
    return res


def search_summary(res: SearchResult, run, top: int = 10) -> str:
    from collectives.ledger import human_bytes

    from .report import table
    cfg = run.model
    lines = [f"\nplayground plan --search: {res.considered} layouts of {cfg.n_params():,} parameters on "
             f"{run.hardware}, {res.planned} planned in {res.wall_s:.1f} s; {len(res.fits)} fit, "
             f"the {min(top, len(res.fits))} fastest:"]
    rows = []
    for p, layout in res.fits[:top]:
        peak = max(v["memory"]["peak_total"] for v in p.values)
        rows.append([layout.describe(), layout.micro_batch_size, f"{p.step_s * 1e3:.3f} ms", f"{p.tokens_per_s:,.0f}",
                     f"{100 * p.mfu:.1f}%", human_bytes(peak)])
    if rows:
        lines.append(table(["layout", "micro-batch", "step", "tokens/s", "MFU", "peak memory"], rows, left=1))
    reasons: dict = {}
    for layout, kind, why in res.rejected:
        reasons.setdefault(kind, []).append((layout, why))
    if reasons:
        lines.append("\nrejected (how many, and the first of each kind):")
        for kind, items in reasons.items():
            layout, why = items[0]
            lines.append(f"  {len(items):>5}  {kind}: e.g. {layout.describe()}: {why}")
    return "\n".join(lines)
