"""Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision
Training"): the loss is multiplied by a scale so that small gradients survive fp16; a step
whose gradients overflowed (inf or NaN on any rank) is skipped and the scale halved; after
`growth_interval` good steps in a row the scale doubles.
"""
from __future__ import annotations

import torch

from collectives import ReduceOp


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0
        self.skipped = 0

    def found_overflow(self, grads, groups, label: str, device=None) -> bool:
        """Whether any rank's gradients hold an inf or NaN (one small all-reduce over each of
        `groups`, so every rank decides the same). The groups must span every rank holding
        part of the model's gradients: a tensor-parallel slice that skipped while the other
        slices stepped would leave their replicated weights apart (Megatron-LM all-reduces
        its found_inf over the model-parallel group too)."""
        device = device or grads[0].device
        # the flag made on the device and read on the host once, after the all-reduce
        flag = (torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any().to(torch.float32).reshape(1)
                if grads else torch.zeros(1, dtype=torch.float32, device=device))
        for group in groups:
            group.all_reduce(flag, op=ReduceOp.MAX, label=label)
        if flag.is_meta:  # a plan's gradients hold no values: no step overflows. Under the compute
            try:  # model the read reads zero, the host waiting as the run's does (simulator/
                return bool(flag.item())  # compute_model.py); a step it does not time cannot read
            except RuntimeError:
                return False
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth_factor
