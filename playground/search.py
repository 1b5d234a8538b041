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
with one (ZeRO-2/3 under a pipeline move ZeRO-1's bytes and hold as much during the
step); 1F1B and, where the layers and microbatches allow, interleaved 1F1B with two
chunks per rank; activation checkpointing none, selective and
full; and, where dp spans nodes, hybrid sharding (ZeRO within the dp ranks of one node, or
of 2, 4, ... nodes, the shards replicated across the rest) beside ZeRO over all of dp. Axes the caller fixes (`fixed`)
are not searched.

Each candidate is first held to `Layout.validate` (each strategy's rules) and to lower
bounds of its memory: the model states alone (bf16 weights and gradients, fp32 master
weights and moments, split by tp·pp and sharded by ZeRO over its shard group: the one
formula of zero.model_state_bytes), and, in a pruned search, the states held all through
a step with one microbatch's activations in a rank's blocks (`memory_lower_bound`, one
block's activations from the plans that bound its time); the survivors are estimated
(`estimate`), and one
whose peak exceeds the profile's HBM less the allocator's headroom (playground/fits.py: 12%
by default) is rejected with its peak. Checkpointing modes are
tried in the order none, selective, full, and a layout that fits with one is not tried
with the next: recomputation only adds time. The `exact` fastest that fit are then
planned in full (`planning.plan`), so the layouts the search prints are plans, not
estimates (one whose full plan exceeds the HBM is rejected then, and the next taken).

Estimates share the work of identical parts (the search's sub-plans): every block of the
model is the same, so a rank's step time and peak memory are affine in the blocks each
pipeline chunk holds, k (compute, activations, parameters and their states, the gradient
buckets: per block; the embedding, the head and the schedule's constant part: not); in
the microbatches m once every stage is busy (1F1B's makespan is (m + p - 1) steps and its
peak holds min(m, p) microbatches: affine from m = p; the interleaved schedule's warm-up
holds up to about 3p chunks, so from m = 2p; without a pipeline, gradient accumulation
repeats one microbatch: from m = 1, and from m = 2 under ZeRO-2/3, whose gradient shards
exist from the first microbatch's backward to the step); and in the pipeline's depth p, for a fixed m ≥ p (2p
interleaved), when every pipeline hop crosses nodes at any depth: the fill and drain add
one step per stage, the first stage holds one more microbatch per stage, and the last
stage (the head) holds the same at any depth. The blocks are affine from k = 1, and from
k = 3 under ZeRO-3 (the gathered units and gradient shards in flight settle from three
blocks: below that the prefetch of the next unit meets the embedding's and the head's, and
MPT-70b's peak under ZeRO-3 on 64 H100s, extrapolated from two and three blocks, was 109 GB;
from three and four, 48 GB, equal to full plans at 16 blocks). So a layout is
planned at k ∈ {k0, k0 + 1} blocks per chunk, at two microbatch counts from m0 (the next
the schedule allows: m0 + 1, interleaved m0 + p) and, for a pipeline deeper than 3, at 2
and 3 stages, on the same shapes otherwise (`points`), and its step is the multilinear
extrapolation of those plans to its own k, m and p. So is each pipeline stage's peak,
apart, and the largest is taken: the stage holding the overall peak may change between
the planned points (the head's stage at 2 stages or few blocks, the first stage's
microbatches at 16 or many), and across depths the first and the last stage are
extrapolated (the middle stages hold fewer microbatches than the first and no head). The product terms carry the
compute, which grows with k·m, and the bubble, with k·p. tests/test_search.py holds the
estimates to the full plans on the tiny preset; the README ("Planning at scale") gives
their accuracy and cost at 70B.
"""
from __future__ import annotations

import bisect
import concurrent.futures
import math
import multiprocessing
import os
import time
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from model.config import divisors
from simulator import load_hardware
from simulator.cost_model import collective_cost
from zero.rules import model_state_bytes

from .fits import DEFAULT_HEADROOM, usable
from .layout import Layout, LayoutError
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
                    # hybrid sharding: ZeRO within the dp ranks of a node (or of 2, 4, ... nodes),
                    # the shards replicated across the rest
                    node = gpus_per_node // (tp * cp) if gpus_per_node % (tp * cp) == 0 else 0
                    shards = [node << j for j in range(32) if 1 < node << j < dp] if node else []
                    replicas = [1] + [dp // n for n in shards if dp % n == 0]
                    for zero in options("zero", [1] if pp > 1 else [1, 3]):
                        schedules = [("1f1b", 1)]
                        if pp > 1 and cfg.n_layers % (2 * pp) == 0 and m % pp == 0:
                            schedules.append(("interleaved", 2))
                        for schedule, v in schedules if pp > 1 else [("1f1b", 1)]:
                            for rep in options("dp_replicate", replicas):
                                for ac in options("ac", ["none", "selective", "full"]):
                                    out.append(Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero,
                                                      schedule=schedule, microbatches=m, virtual_stages=v,
                                                      sequence_parallel=tp > 1, micro_batch_size=mbs, ac=ac,
                                                      dp_replicate=rep))
    return out


def block_compute(run, tp: int, cp: int, micro_batch_size: int, ac: str = "none") -> tuple:
    """(per block, outside the blocks, activations per block): seconds of one microbatch on
    a rank of `tp` × `cp` with checkpointing `ac`, as the simulator times them with no data
    or pipeline parallelism: the device's time less its waits for the host (its kernels,
    memory-bound ones included, and the tensor- and context-parallel calls it waits for,
    which block it at any data-parallel degree); and the bytes of activations one block
    adds to the peak of one microbatch's forward (data parallelism and ZeRO leave them as
    they are). From four plans of one and two blocks and one and two microbatches: the
    mixed difference is one block's; the difference in microbatches at one block, less it,
    what each microbatch adds outside the blocks (embedding, head, loss); what is paid once
    a step (the optimizer) falls out of both."""
    c, act = {}, {}
    for k in (1, 2):
        for m in (1, 2):
            layout = Layout(tp=tp, cp=cp, sequence_parallel=tp > 1, micro_batch_size=micro_batch_size,
                            microbatches=m, zero=1, ac=ac)
            values = plan(replace(run, model=run.model.with_(n_layers=k), layout=layout)).values
            step = values[0]["step"]
            c[k, m] = step["time"] - step["host"]
            act[k, m] = min(v["memory"]["peak_activations"] for v in values)
    block = max(0.0, c[2, 2] - c[2, 1] - c[1, 2] + c[1, 1])
    return block, max(0.0, c[1, 2] - c[1, 1] - block), max(0.0, act[2, 1] - act[1, 1])


def step_lower_bound(run, layout: Layout, block: tuple, hw=None) -> float:
    """Seconds a step of `layout` (with `run`'s model, dtypes and hardware `hw`) takes at
    least, as the simulator times it, given `block`, one microbatch's time in a block and
    outside the blocks on a rank of its tp × cp with its checkpointing (`block_compute`):
    each rank's blocks (n_layers / pp of them) for each microbatch and what each
    microbatch adds outside them (with a pipeline, half of it: on the stage holding the
    embedding or the head), plus a pipeline's fill and drain, (p - 1) / v
    chunk-microbatches (Narayanan et al. 2021, section 2.2: the bubble of 1F1B, interleaved
    with v chunks); plus what data parallelism's calls add to the compute stream at least,
    and at least as long as its busiest communication stream (`communication_bound`). The
    optimizer only adds. 0 for a model with experts, whose routing decides the experts'
    compute."""
    cfg = run.model
    if cfg.n_experts:
        return 0.0
    per_block, outside = block[:2]
    bubble = (layout.pp - 1) / layout.virtual_stages if layout.schedule in ("1f1b", "interleaved") else 0.0
    blocks = per_block * cfg.n_layers / layout.pp * (layout.microbatches + bubble)
    # what each microbatch adds outside the blocks: all of it without a pipeline; with one,
    # the first stage adds the embedding's part and the last the head's, one of them at
    # least half
    compute = blocks + outside * layout.microbatches * (1.0 if layout.pp == 1 else 0.5)
    added, busiest = communication_bound(run, layout, hw or load_hardware(run.hardware))
    return max(compute + added, busiest)


def data_parallel_calls(run, layout: Layout) -> list:
    """[(op, bytes, group ranks, calls)]: the data-parallel collectives a rank holding
    n_layers / pp blocks issues in one step, at least (zero/zero.py): its blocks' parameters
    alone (at least 1/tp of each block's), in the compute dtype's width and the gradients in
    the reduce dtype's, on rank 0's groups (every shard group is placed alike). ZeRO-0:
    one all-reduce; 1: a reduce-scatter and the all-gather after the step; 2 and 3 without
    a pipeline reduce every microbatch, and 3 gathers twice per microbatch (before the
    forward and the backward); under a pipeline they reduce once and 3 gathers once.
    Hybrid sharding adds the all-reduce of each reduced shard across the replicas."""
    cfg = run.model
    wide, reduce_width = _width(run.dtype), _width(run.reduce_dtype or run.grad_dtype or run.dtype)
    local = _block_params(cfg, layout.tp) * cfg.n_layers // layout.pp
    shard_group = [j * layout.cp * layout.tp + c * layout.tp for j in range(layout.dp_shard) for c in range(layout.cp)]
    if len(shard_group) == 1:
        return []
    m = layout.microbatches
    each = 1 if layout.pp > 1 or layout.zero < 2 else m  # reductions per step
    if layout.zero == 0:
        return [("all_reduce", local * reduce_width, shard_group, 1)]
    calls = [("reduce_scatter", local * reduce_width, shard_group, each),
             ("all_gather", local * wide, shard_group, 2 * m if layout.zero == 3 and layout.pp == 1 else 1)]
    if layout.dp_replicate > 1:
        stride = layout.dp_shard * layout.cp * layout.tp
        calls.append(("all_reduce", local / len(shard_group) * reduce_width,
                      [i * stride for i in range(layout.dp_replicate)], each))
    return calls


def _block_params(cfg, tp: int) -> float:
    """Parameters of one block on a rank of `tp` (at least 1/tp of each block's: the
    norms stay whole)."""
    return (cfg.with_(n_layers=2).n_params() - cfg.with_(n_layers=1).n_params()) / tp


def _width(dtype: str) -> int:
    """Bytes per element of the dtype named `dtype` ("bfloat16", "float32", ...)."""
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def communication_bound(run, layout: Layout, hw) -> tuple:
    """(added, busiest): seconds the data-parallel calls of a step (`data_parallel_calls`)
    add to a rank's compute stream at least, and the longest any one of its communication
    streams is busy, both from their alpha-beta costs without the latency terms (each
    call's cost is that much at least, and linear in its bytes, so the calls of a step cost
    at least their bytes in one call: simulator/cost_model.py).

    A call on a stream of its own adds to the compute stream (simulator/clock.py): waited
    after it ended, the compute beside it stretched by s·d (s: the profile's
    overlap_slowdown, d its duration); waited at t while it runs, the stretch s·(t − start)
    then the rest exposed, at least s·d / (1 + s) over every t; waited before it started,
    all of d. And a step lasts at least as long as any of its streams is busy."""
    free = replace(hw, nvlink_latency=0.0, network_latency=0.0)
    s = hw.overlap_slowdown or 0.0
    added, streams = 0.0, {}
    for op, size, ranks, calls in data_parallel_calls(run, layout):
        d = calls * collective_cost(op, size, ranks, free)[0]
        added += s * d / (1 + s)
        streams[tuple(ranks)] = streams.get(tuple(ranks), 0.0) + d
    return added, max(streams.values(), default=0.0)


def memory_lower_bound(cfg, layout: Layout, block: tuple) -> float:
    """Bytes a rank holding n_layers / pp blocks has in use at least when one microbatch's
    forward has gone through them (each schedule's stage holds at least that before the
    microbatch's backward): the states it holds at every moment of the second step (AdamW
    made its moments at the first: playground/planning.py) for its blocks' parameters (at
    least 1/tp of each block's): fp32 master weights and moments, sharded by ZeRO over its
    shard group, bf16 compute copies below ZeRO-3 and the full gradients below ZeRO-2
    (zero/zero.py: stages 2-3 make their gradient shards in the backward); and its blocks'
    activations, `block`'s third part per block (`block_compute`). 0 for a model with
    experts, whose routing decides what the experts hold."""
    if cfg.n_experts or len(block) < 3:
        return 0.0
    params = _block_params(cfg, layout.tp) * (cfg.n_layers // layout.pp)
    shard = layout.dp_shard * layout.cp
    states = model_state_bytes(params, layout.zero, shard, width=4, compute_width=2)
    if layout.zero >= 2:  # (less the gradient shards, made in the backward)
        states -= 2 * params / shard
    return states + block[2] * (cfg.n_layers // layout.pp)


def model_states_bound(cfg, layout: Layout) -> float:
    """Bytes of model states per rank, a lower bound of its peak: each rank holds 1/(tp·pp)
    of the parameters in mixed precision (bf16 compute copies and gradients, fp32 master
    weights and AdamW moments), ZeRO sharding them by stage over its shard group (dp_shard·cp;
    zero.model_state_bytes)."""
    return model_state_bytes(cfg.n_params() / (layout.tp * layout.pp), layout.zero, layout.dp_shard * layout.cp,
                             width=4, compute_width=2)


@dataclass
class Estimate:
    """A layout's step and peak memory: from shallow plans (`estimate`), or its full plan's
    (`exact`). The plans themselves are not kept (a search holds hundreds of estimates)."""
    layout: Layout
    step_s: float
    peak: float  # bytes, the largest over the ranks
    plans: int  # the plans it took
    exact: bool = False

    @classmethod
    def planned(cls, p, plans: int) -> "Estimate":
        """The full plan `p` of its layout, after `plans` plans in all."""
        return cls(p.run.layout, p.step_s, p.peak, plans, exact=True)


def _weights(points: tuple, x: int) -> list:
    """Linear (Lagrange) weights of `points` (one or two) at x."""
    if len(points) == 1:
        return [1.0]
    a, b = points
    return [(b - x) / (b - a), (x - a) / (b - a)]


def points(layout, n_layers: int, gpus_per_node: int, uneven: bool = False) -> tuple:
    """(stages, blocks per chunk, microbatches): the values of p, k and m a layout is
    planned at for its estimate (module docstring), each one or two points.

    p: (2, 3) for a pipeline deeper than 3 whose every stage is busy (m ≥ p, interleaved
    m ≥ 2p) and whose neighbours sit on other nodes at any depth (dp·cp·tp a multiple of
    a node), else its own. k: k0 and k0 + 1 (k0 = 3 under ZeRO-3, else 1). m: from m0 (1
    without a pipeline, 2 under ZeRO-2/3, whose gradient shards, made by the first
    microbatch's backward, are held through the later forwards; the largest p plus one, the
    first count with a steady phase: at m = p a 1F1B schedule is its warm-up and cool-down
    alone, and the host's lead over the device there differs from the steady phase's, which
    each further microbatch repeats; interleaved twice the largest p), the next count the
    schedule allows at every p (interleaved: a multiple of each p). `uneven`: stages of
    blocks given one by one, which no other depth or block count holds: p and k are the
    layout's own, m alone is extrapolated."""
    p, v, m = layout.pp, layout.virtual_stages, layout.microbatches
    k = n_layers // (p * v)
    k0 = 3 if layout.zero >= 3 else 1
    ks = (k0, k0 + 1) if k > k0 + 1 and not uneven else (k,)
    busy = m >= (2 * p if v > 1 else p)
    deep = p > 3 and busy and (layout.dp * layout.cp * layout.tp) % gpus_per_node == 0 and not uneven
    for ps in ([(2, 3)] if deep else []) + [(p,)]:
        step = math.lcm(*ps) if v > 1 else 1
        m0 = (2 if layout.zero >= 2 else 1) if p == 1 else 2 * max(ps) if v > 1 else max(ps) + 1
        m0 = -(-m0 // step) * step
        ms = (m0, m0 + step) if m > m0 + step else (m,)
        if all(mm % step == 0 for mm in ms):  # (interleaved: every point a multiple of each p)
            return ps, ks, ms
    raise AssertionError("a layout's own depth and microbatches are always a valid point")


def estimate(run) -> Estimate:
    """`run`'s layout (module docstring: planned at one or two values of each of p, k and
    m, `points`, and extrapolated multilinearly to its own)."""
    cfg, layout = run.model, run.layout
    v = layout.virtual_stages
    k, m = cfg.n_layers // (layout.pp * v), layout.microbatches
    uneven = layout.stage_layers is not None  # stages of blocks given one by one: only m is extrapolated
    ps, ks, ms = points(layout, cfg.n_layers, load_hardware(run.hardware).gpus_per_node, uneven=uneven)
    if ks == (k,) and ms == (m,) and ps == (layout.pp,):  # small enough to plan as it is
        return Estimate.planned(plan(run), 1)
    # per pipeline stage, its largest peak over the stage's ranks (across depths: the first and the last)
    step, peaks = 0.0, [0.0] * (2 if len(ps) > 1 else layout.pp)
    for pp, wp in zip(ps, _weights(ps, layout.pp)):
        for kk, wk in zip(ks, _weights(ks, k)):
            for mm, wm in zip(ms, _weights(ms, m)):
                model = cfg if uneven else cfg.with_(n_layers=pp * v * kk)
                p = plan(replace(run, model=model, layout=replace(layout, pp=pp, microbatches=mm)))
                w = wp * wk * wm
                step += w * p.step_s
                stages = _stage_peaks(p, pp)
                if len(ps) > 1:
                    stages = [stages[0], stages[-1]]
                peaks = [a + w * x for a, x in zip(peaks, stages)]
    return Estimate(layout, step, max(peaks), len(ps) * len(ks) * len(ms))


def _stage_peaks(p, pp: int) -> list:
    """The largest peak of each pipeline stage's ranks in plan `p` (pipeline outermost in
    the rank order). Each is affine in k and m by itself, while the rank holding the overall
    peak may change between the planned points (the head's stage at one depth, the first
    stage's microbatches at another), so they are extrapolated apart and the largest taken."""
    inner = len(p.values) // pp
    return [max(v["memory"]["peak_total"] for v in p.values[s * inner:(s + 1) * inner]) for s in range(pp)]


@dataclass
class SearchResult:
    fits: list = field(default_factory=list)  # Estimate, fastest first (the first `exact` planned in full)
    rejected: list = field(default_factory=list)  # (layout, kind, reason)
    considered: int = 0
    estimated: int = 0  # layouts estimated
    planned: int = 0  # plans run (shallow and full)
    pruned: int = 0  # layouts whose lower bound exceeded the fastest that fit: never planned
    bound_violations: int = 0  # estimates below their layout's lower bound (none expected)
    wall_s: float = 0.0


class _Inline:
    """A finished future: the search's work done in its own process (one job)."""

    def __init__(self, fn, *args):
        self._value = fn(*args)

    def result(self):
        return self._value


def search(run, world: int, global_batch: int, fixed: dict | None = None, exact: int = 3,
           headroom: float = DEFAULT_HEADROOM, prune: bool = True, jobs: int | None = None) -> SearchResult:
    """Estimate the candidate layouts of `run` (its model, dtype and hardware) on `world`
    ranks with `global_batch` sequences per step that could be among the fastest; plan the
    `exact` fastest that fit in full. A layout fits when its peak leaves `headroom` of the
    HBM free (playground/fits.py).

    Branch and bound: candidates are taken in order of their step's lower bound
    (`step_lower_bound`, from one block's compute planned once per tp, cp, micro-batch
    size and checkpointing, `block_compute`, and the least its data-parallel calls cost,
    `communication_bound`), those whose peak must exceed the HBM are rejected unplanned
    (`memory_lower_bound`), and once `exact` layouts fit, one whose bound exceeds the
    `exact`-th fastest estimate cannot be among the fastest: it and the rest are pruned
    unplanned. Each layout confirmed in full first estimates every candidate whose bound
    is below its step, so the fastest `exact` are those of a search that estimated every
    layout (its estimates being no lower than their bounds, which the search counts:
    `bound_violations`). `prune=False` estimates every candidate (the reference the tests
    and benchmarks/search_speed.py hold the pruned search to). Estimates run in `jobs`
    worker processes (default: the CPU count for more than 100 candidates, else this
    process; plans on meta tensors hold the GIL, so threads would not help), the next candidates in bound order while others run: the
    same layouts are estimated or pruned, give or take the ones in flight when the bound
    is passed."""
    t0 = time.perf_counter()
    hw = load_hardware(run.hardware)
    cap = usable(hw, headroom)
    res = SearchResult()
    fitted: set = set()  # layouts (without their checkpointing) that fit with less recomputation
    layouts = candidates(run.model, world, global_batch, hw.gpus_per_node, fixed)
    # (a worker takes seconds to start: small searches run in this process)
    jobs = max(1, jobs or ((os.cpu_count() or 1) if len(layouts) > 100 else 1))
    pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) \
        if jobs > 1 else None
    quiet = replace(run, progress=False)

    def submit(fn, *args):
        return pool.submit(fn, *args) if pool is not None else _Inline(fn, *args)
    bar = tqdm(total=len(layouts) + exact, desc="search: bounds", unit="layout", dynamic_ncols=True,
               disable=not run.progress)
    try:
        # one block's compute per microbatch for each (tp, cp, micro-batch) among the candidates
        keys = sorted({_key(lay) for lay in layouts}) \
            if prune and not run.model.n_experts else []
        futures = {key: submit(_block_compute_or_zero, quiet, *key) for key in keys}
        blocks = {key: f.result() for key, f in futures.items()}
        bounds = [step_lower_bound(run, lay, blocks[_key(lay)], hw)
                  if blocks else 0.0 for lay in layouts]
        bar.set_description("search")
        order = sorted(range(len(layouts)), key=lambda i: bounds[i])
        sorted_bounds = [bounds[i] for i in order]
        res.considered = len(layouts)
        nxt = 0  # the next candidate, in order of bound

        def kth() -> float:
            return sorted(e.step_s for e in res.fits)[exact - 1] if len(res.fits) >= exact else float("inf")

        def precheck(i: int) -> bool:
            """Reject candidate i without planning where a rule or the memory bound does;
            whether it is left to estimate."""
            layout = layouts[i]
            bar.update()
            if replace(layout, ac="none") in fitted:
                res.rejected.append((layout, "dominated", f"ac={layout.ac} not planned: the same layout fits with "
                                     f"less recomputation, which only adds time"))
                return False
            try:
                layout.validate(run.model)
            except LayoutError as e:
                res.rejected.append((layout, "invalid layout", str(e)))
                return False
            states = model_states_bound(run.model, layout)
            if states > cap:
                res.rejected.append((layout, "model states exceed HBM", f"model states alone "
                                     f"{states / 2**30:.1f} GiB > {_of_hbm(hw, headroom)}"))
                return False
            held = memory_lower_bound(run.model, layout, blocks[_key(layout)]) if blocks else 0.0
            if held > cap:
                res.rejected.append((layout, "states and activations exceed HBM", f"at least {held / 2**30:.1f} "
                                     f"GiB at the end of a microbatch's forward (its blocks' activations and the "
                                     f"states held throughout) > {_of_hbm(hw, headroom)}"))
                return False
            return True

        def collect(i: int, e) -> None:
            layout = layouts[i]
            res.estimated += 1
            res.planned += e.plans
            res.bound_violations += e.step_s < bounds[i] * (1 - 1e-6)
            if e.peak > cap:
                res.rejected.append((layout, "planned peak exceeds HBM", _over(e, hw, headroom)))
            elif layout.ac != "none" and replace(layout, ac="none") in fitted:  # (estimated beside it)
                res.rejected.append((layout, "dominated", f"ac={layout.ac}: the same layout fits with less "
                                     f"recomputation, which only adds time"))
            else:
                res.fits.append(e)
                fitted.add(replace(layout, ac="none"))
            # what is left: the candidates whose bound is below the current `exact`-th fastest
            left = max(0, bisect.bisect_right(sorted_bounds, kth(), lo=nxt) - nxt)
            bar.total = bar.n + left + exact
            bar.set_postfix_str(f"{res.estimated} estimated from shallow plans, {len(res.fits)} fit, {left} left "
                                f"under the bound, then {exact} planned in full", refresh=False)

        def scan(limit) -> None:
            """Screen every candidate whose bound is at most limit() (asked again as fits come)."""
            nonlocal nxt
            pending: dict = {}
            while True:
                while len(pending) < jobs and nxt < len(order) and bounds[order[nxt]] <= limit():
                    i = order[nxt]
                    nxt += 1
                    if precheck(i):
                        pending[submit(estimate, replace(quiet, layout=layouts[i]))] = i
                if not pending:
                    return
                if pool is None:
                    done = list(pending)
                else:
                    done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for f in done:
                    collect(pending.pop(f), f.result())

        scan(kth)
        confirmed: list = []
        bar.set_description("search: the fastest in full")

        def unconfirmed() -> list:
            return sorted((e for e in res.fits if not any(e is c for c in confirmed)), key=lambda e: e.step_s)
        while len(confirmed) < exact:
            rest = unconfirmed()
            if rest:
                first = rest[0].step_s
                scan(lambda: first)  # nothing unscreened may be faster than the next to confirm
                rest = unconfirmed()
            elif nxt < len(order):
                upto = bounds[order[nxt]]
                scan(lambda: upto)
                continue
            if not rest:
                break
            e = rest[0]
            res.fits.remove(e)
            if not e.exact:
                bar.set_postfix_str(f"planning {e.layout.describe()} in full", refresh=True)
                res.planned += 1
                e = Estimate.planned(plan(replace(quiet, layout=e.layout)), e.plans + 1)
                bar.update()
                if e.peak > cap:
                    res.rejected.append((e.layout, "planned peak exceeds HBM", _over(e, hw, headroom)))
                    continue
            res.fits.append(e)
            confirmed.append(e)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        bar.close()
    for i in order[nxt:]:
        res.rejected.append((layouts[i], "pruned by its lower bound",
                             f"at least {bounds[i] * 1e3:.0f} ms a step (its blocks' time, the pipeline's fill "
                             f"and drain, its data-parallel calls) > the {_ordinal(exact)} fastest that fit, {kth() * 1e3:.0f} ms: not "
                             f"planned"))
        res.pruned += 1
    res.fits = sorted(confirmed, key=lambda e: e.step_s) + unconfirmed()
    res.wall_s = time.perf_counter() - t0
    return res


def _block_compute_or_zero(run, tp: int, cp: int, micro_batch_size: int, ac: str) -> tuple:
    """`block_compute`, or zeros (no bound) where the model does not divide by tp or cp."""
    try:
        return block_compute(run, tp, cp, micro_batch_size, ac)
    except (LayoutError, ValueError):
        return 0.0, 0.0, 0.0


def _key(layout: Layout) -> tuple:
    """What `block_compute` depends on."""
    return layout.tp, layout.cp, layout.micro_batch_size, layout.ac


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")


def _of_hbm(hw, headroom: float) -> str:
    return f"{usable(hw, headroom) / 2**30:.1f} GiB usable ({1 - headroom:.0%} of {hw.hbm_capacity / 2**30:.1f} GiB of HBM)"


def _over(e: Estimate, hw, headroom: float) -> str:
    what = "planned" if e.exact else "estimated"
    return f"{what} peak {e.peak / 2**30:.1f} GiB > {_of_hbm(hw, headroom)}"


def search_summary(res: SearchResult, run, top: int = 10) -> str:
    from collectives.ledger import human_bytes

    from .report import table
    cfg = run.model
    hw = load_hardware(run.hardware)
    lines = [f"\nplayground plan --search: {res.considered} layouts of {cfg.n_params():,} parameters on "
             f"{run.hardware}, {res.estimated} estimated ({res.planned} plans), {res.pruned} pruned by their lower bound"
             + (f" ({res.bound_violations} estimates fell below their bound: the pruning may have missed one)"
                if res.bound_violations else "") + f", in {res.wall_s:.1f} s; "
             f"{len(res.fits)} fit, the {min(top, len(res.fits))} fastest (planned in full unless marked *):"]
    rows = []
    for e in res.fits[:top]:
        tokens_per_s = e.layout.global_batch * cfg.seq_len / e.step_s
        mfu = cfg.mfu(tokens_per_s, e.layout.world, hw.peak_bf16_flops)
        rows.append([e.layout.describe() + ("" if e.exact else " *"), e.layout.micro_batch_size,
                     f"{e.step_s * 1e3:.3f} ms", f"{tokens_per_s:,.0f}", f"{100 * mfu:.1f}%", human_bytes(e.peak)])
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
