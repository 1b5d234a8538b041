"""The memory tracker audited against the bytes the rank's program really holds.

A plan's peak is the model states plus the peak of the tracker's transient bytes
(simulator/memory.py): activations, backward's temporaries, communication buffers, step
gradients. `audit` runs a layout's ranks as a plan does (meta tensors, two steps, the
second measured) under `simulator.live_bytes.LiveBytes`, which counts every storage the
rank's ops make while it lives, and compares over the second step's forward and backward
the tracker's peak of transient bytes with the peak of the bytes made in that step and
alive at once. The two agree when the tracker is told of everything the program holds;
where they differ, the plan misses (or invents) that many bytes, on a GPU as here.

The optimizer's step is left out: on a GPU it is fused kernels with no temporaries to speak
of, on the meta device op-by-op code with many, so its live bytes say nothing of a GPU's.
ZeRO-3 is refused: it frees its parameters by resizing their storages, which no dispatch
mode sees (live_bytes.py).
"""
from __future__ import annotations

from collectives import launch
from simulator import SimulatedTime, load_hardware
from simulator.live_bytes import LiveBytes

from .planning import planned_steps


def _audit_rank(world, run) -> dict:
    live = LiveBytes()
    with live:
        steps = planned_steps(world, run)
        memory = next(steps).memory
        live.reset_peak()
        live_start, tracked_start = live.live, memory.transient
        memory.peak_transient = tracked_start
        next(steps)  # (the forward and backward done)
        out = {"tracked": memory.peak_transient - tracked_start, "live": live.peak - live_start}
        for _ in steps:  # (the optimizer, outside the comparison)
            pass
    out["missed"] = out["live"] - out["tracked"]
    return out


def audit(run) -> list:
    """Per rank of `run` (a RunConfig): {"tracked": the tracker's peak of transient bytes over
    the second step's forward and backward, "live": the peak of the bytes made in it and alive
    at once, "missed": live − tracked}. Every rank runs (no stand-ins): a few ranks at most."""
    run.layout.validate(run.model)  # (a clear error for a layout no plan would take)
    if run.layout.zero == 3:
        raise ValueError("memory audit: ZeRO-3 frees parameters by resizing storages, which the live count does not see")
    hardware = load_hardware(run.hardware or "h100-sxm")
    res = launch(_audit_rank, run.layout.world, args=(run,), time_model=SimulatedTime(hardware))
    return list(res.values)
