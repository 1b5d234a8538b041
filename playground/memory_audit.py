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

import torch

from collectives import launch
from pipeline import fewest_microbatches
from simulator import SimulatedTime, load_hardware
from simulator.live_bytes import LiveBytes

from .rank_program import RankProgram


def _audit_rank(world, run) -> dict:
    layout = run.layout
    live = LiveBytes()
    with live:
        dtype = torch.float32 if run.dtype in ("bfloat16", "float16") else run.param_dtype
        rank = RankProgram(world, run, "meta", dtype=dtype)
        batch = torch.empty(layout.global_batch, run.model.seq_len + 1, dtype=torch.long, device="meta")
        micro = rank.microbatches(rank.local(batch))
        compute = world.timing.compute_model
        fewest = fewest_microbatches(layout.schedule, layout.pp) if layout.pp > 1 else 1
        memory = rank.memory
        for step in range(2):
            with compute.paused() if step == 0 else compute.step():
                if step == 1:
                    live.reset_peak()
                    live_start, tracked_start = live.live, memory.transient
                    memory.peak_transient = tracked_start
                total = rank.forward_backward(micro[:fewest] if step == 0 else micro)
                if step == 1:
                    out = {"tracked": memory.peak_transient - tracked_start, "live": live.peak - live_start}
                rank.nonfinite(total)
                rank.update()
                rank.average_loss(total)
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
