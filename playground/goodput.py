"""Planning for failures: what a checkpoint costs a layout, and the checkpoint interval that
gives the most useful work between failures (Young 1974, "A first order approximation to the
optimum checkpoint interval"; Daly 2006, "A higher order estimate of the optimum checkpoint
interval for restart dumps").

A checkpoint (playground/checkpoint.py) holds each parameter's fp32 master weights and AdamW's
two moments, 12 bytes a parameter, each piece written once, by the lowest rank holding it:
under ZeRO every rank of a data-parallel group writes its shard, without it one rank of the
group writes the whole replica. Its time is the largest writer's bytes at the stated storage
bandwidth per rank (`--checkpoint-gbps`). With a failure rate per GPU (`--mtbf-hours`), the
job fails every M = MTBF / N on average; restarting costs R (the launcher's `--restart-seconds`
and reading the checkpoint back). Daly's model: a job of T_s seconds of work, checkpointed every
τ seconds of work at δ seconds each, takes T_w = M e^(R/M) (e^((τ+δ)/M) - 1) T_s / τ, so its
goodput is T_s / T_w; its best τ is Daly's higher-order estimate (Young's √(2δM) first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BYTES_PER_PARAMETER = 12  # fp32 master weights and AdamW's two moments


def checkpoint_bytes(config, layout) -> int:
    """Bytes the busiest writing rank writes for one checkpoint of `layout`."""
    per_replica = config.n_params() / (layout.tp * layout.pp)
    shard = layout.dp * layout.cp // max(1, layout.dp_replicate) if layout.zero else 1  # (the ranks splitting a replica)
    return int(math.ceil(BYTES_PER_PARAMETER * per_replica / shard))


def young_interval(delta: float, mtbf: float) -> float:
    """Young's optimum: √(2 δ M)."""
    return math.sqrt(2 * delta * mtbf)


def daly_interval(delta: float, mtbf: float) -> float:
    """Daly's higher-order optimum (2006, eq. 37): √(2δM) [1 + √(δ/2M)/3 + (δ/2M)/9] - δ for
    δ < 2M, else M."""
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def goodput(tau: float, delta: float, mtbf: float, restart: float) -> float:
    """The fraction of wall time that is useful work, checkpointing every τ seconds of work
    (Daly 2006, eq. 13: T_s / T_w)."""
    return tau / (mtbf * math.exp(restart / mtbf) * (math.exp((tau + delta) / mtbf) - 1))


@dataclass
class FailurePlan:
    bytes_per_rank: int
    write_s: float  # δ
    mtbf_s: float | None = None  # the job's M (None: no failure rate given)
    restart_s: float | None = None  # R
    interval_s: float | None = None  # Daly's τ
    interval_steps: int | None = None
    goodput: float | None = None  # at that interval (rounded to whole steps)
    goodput_every_step: float | None = None  # for comparison: a checkpoint every step


def failure_plan(config, layout, step_s: float, gbps: float, mtbf_hours: float | None = None,
                 restart_s: float = 60.0) -> FailurePlan:
    """The checkpoint's cost for `layout` at `gbps` GB/s per writing rank, and with a failure
    rate per GPU the best interval (in whole steps of `step_s`) and its expected goodput."""
    nbytes = checkpoint_bytes(config, layout)
    delta = nbytes / (gbps * 1e9)
    out = FailurePlan(nbytes, delta)
    if mtbf_hours:
        mtbf = mtbf_hours * 3600 / layout.world
        restart = restart_s + delta  # the launcher's restart, then the checkpoint read back
        tau = daly_interval(delta, mtbf)
        steps = max(1, round(tau / step_s))
        out.mtbf_s, out.restart_s, out.interval_s, out.interval_steps = mtbf, restart, tau, steps
        out.goodput = goodput(steps * step_s, delta, mtbf, restart)
        out.goodput_every_step = goodput(step_s, delta, mtbf, restart)
    return out
