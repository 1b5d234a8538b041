"""The memory tracker audited against the bytes the rank's program really holds.

A plan's peak is the model states plus the peak of the tracker's transient bytes
(simulator/memory.py): activations, backward's temporaries, communication buffers, step
gradients. `audit` runs a layout's ranks as a plan does (meta tensors, two steps, the
second measured) under `simulator.live_bytes.LiveBytes`, which counts every storage the
rank's ops make while it lives, and compares over the second step's forward and backward
the tracker's peak of transient bytes with the peak of the bytes made in that step and
alive at once. The two agree when the tracker is told of everything the program holds;
where they differ, the plan misses (or invents) that many bytes, on a GPU as here.

A parameter's `.grad` that backward makes (float32 and float64 without ZeRO, whose
gradients have no flat buffer) is a model state to the tracker, and so to the live count
from its accumulation on (`LiveBytes.model_state`).

The optimizer's step is left out: on a GPU it is fused kernels with no temporaries to speak
of, on the meta device op-by-op code with many, so its live bytes say nothing of a GPU's.
ZeRO-3's gathered parameters are seen as their storages are resized (live_bytes.py).
"""
from __future__ import annotations

import torch

from collectives import launch
from simulator import SimulatedTime, load_hardware
from simulator.live_bytes import LiveBytes

from .planning import planned_run, planned_steps


def _audit_rank(world, run) -> dict:
    live = LiveBytes()
    with live:
        steps = planned_steps(world, run)
        rank = next(steps)
        memory = rank.memory
        # a parameter's .grad, made in backward where no strategy gives it a flat buffer (float32
        # and float64 without ZeRO), is a model state to the tracker (`_grad_accumulated`)
        def accumulated(p):
            if p.grad is not None:
                live.model_state(p.grad)
        hooks = [p.register_post_accumulate_grad_hook(accumulated)
                 for p in rank.model.params if isinstance(p, torch.Tensor) and p.is_leaf and p.requires_grad]
        live.reset_peak()
        live_start, tracked_start = live.live, memory.transient
        memory.peak_transient = tracked_start
        next(steps)  # (the forward and backward done)
        out = {"tracked": memory.peak_transient - tracked_start, "live": live.peak - live_start}
        for _ in steps:  # (the optimizer, outside the comparison)
            pass
        for h in hooks:
            h.remove()
    out["missed"] = out["live"] - out["tracked"]
    return out


def audit(run) -> list:
    """Per rank of `run` (a RunConfig): {"tracked": the tracker's peak of transient bytes over
    the second step's forward and backward, "live": the peak of the bytes made in it and alive
    at once, "missed": live − tracked}. Every rank runs (no stand-ins): a few ranks at most."""
    run = planned_run(run)
    hardware = load_hardware(run.hardware or "h100-sxm")
    res = launch(_audit_rank, run.layout.world, args=(run,), time_model=SimulatedTime(hardware))
    return list(res.values)
