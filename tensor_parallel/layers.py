"""Column- and row-parallel linear layers (Shoeybi et al. 2019, "Megatron-LM", section 3).

`ColumnParallelLinear` splits the weight's output features over the TP group: each rank
computes its slice of the outputs from the whole input. `RowParallelLinear` splits the
input features: each rank multiplies its slice of the input and the partial products are
summed. A column-parallel layer followed by a row-parallel one needs one collective at
each end: f (or the sequence all-gather) on the way in, g (or the reduce-scatter) on the
way out. `enter` / `exit_` say whether the layer applies them itself: attention's q, k
and v share one f, applied before them (plan.py).

Each layer is made from the reference layer it replaces (`from_reference`): its weight is
the TP rank's slice of the reference weight (padded at the end when the dimension is not
divisible by tp, as Megatron pads the vocabulary), with that placement attached
(model.placement: a `Shard` of the reference parameter). A reference on the meta device
gives a meta slice, filled later by the model's `materialize`.
"""
from __future__ import annotations

import torch
from torch import nn

from model.placement import Placement, Shard, set_placement

from .mappings import enter_tp, exit_tp


def shard_range(size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, stop, local) of rank's part of `size` split in tp equal parts, padding the
    size up to a multiple of tp: local is the padded part's length, stop - start the real."""
    local = -(-size // tp)
    start = min(rank * local, size)
    return start, min(start + local, size), local


def sharded_parameter(reference: torch.Tensor, name: str, dim: int, group) -> nn.Parameter:
    """The TP rank's slice of `reference` along `dim` as a parameter, with its placement."""
    start, stop, local = shard_range(reference.shape[dim], group.size, group.rank)
    placement = Placement(name, tuple(reference.shape), (Shard(dim, start, stop, local),))
    if reference.is_meta:
        t = torch.empty(placement.local_shape, dtype=reference.dtype, device="meta")
    else:
        t = placement.local(reference.detach()).clone()
    p = nn.Parameter(t)
    set_placement(p, placement)
    return p


class ColumnParallelLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, group, sequence_parallel: bool = False, enter: bool = True,
                 label: str = "tp.column"):
        super().__init__()
        self.group, self.sp, self.enter, self.label = group, sequence_parallel, enter, label
        self.weight = weight

    @classmethod
    def from_reference(cls, linear: nn.Linear, name: str, group, sequence_parallel=False, enter=True,
                       label="tp.column"):
        return cls(sharded_parameter(linear.weight, f"{name}.weight", 0, group), group, sequence_parallel,
                   enter, label)

    def forward(self, x):
        if self.enter:
            x = enter_tp(x, self.group, self.sp, self.label)
        return nn.functional.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    def __init__(self, weight: nn.Parameter, group, sequence_parallel: bool = False, exit_: bool = True,
                 label: str = "tp.row"):
        super().__init__()
        self.group, self.sp, self.exit, self.label = group, sequence_parallel, exit_, label
        self.weight = weight

    @classmethod
    def from_reference(cls, linear: nn.Linear, name: str, group, sequence_parallel=False, exit_=True,
                       label="tp.row"):
        return cls(sharded_parameter(linear.weight, f"{name}.weight", 1, group), group, sequence_parallel,
                   exit_, label)

    def forward(self, x):
        y = nn.functional.linear(x, self.weight)
        return exit_tp(y, self.group, self.sp, self.label) if self.exit else y
