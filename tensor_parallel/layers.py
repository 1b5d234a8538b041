"""Column- and row-parallel linear layers (Shoeybi et al. 2019, "Megatron-LM", section 3).

`ColumnParallelLinear` splits the weight's output features over the TP group: each rank
computes its slice of the outputs from the whole input. `RowParallelLinear` splits the
input features: each rank multiplies its slice of the input and the partial products are
summed. A column-parallel layer followed by a row-parallel one needs one collective at
each end: f (or the sequence all-gather) on the way in, g (or the reduce-scatter) on the
way out. `enter` / `exit_` say whether the layer applies them itself: attention's q, k
and v share one f, applied by the attention before them.

Each weight knows where it sits in the reference (Contract 4): `weight.tp_index` is its
index into the full tensor (of shape `weight.tp_full_shape`) and `weight.tp_rows` the part
of the local tensor that is real (the vocabulary is padded to a multiple of tp).
"""
from __future__ import annotations

import torch
from torch import nn

from .mappings import enter_tp, exit_tp


def shard_range(size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, stop, local) of rank's part of `size` split in tp equal parts, padding the
    size up to a multiple of tp: local is the padded part's length, stop - start the real."""
    local = -(-size // tp)
    start = min(rank * local, size)
    return start, min(start + local, size), local


def sharded_parameter(full: torch.Tensor, dim: int, tp: int, rank: int, dtype, device="cpu") -> nn.Parameter:
    """Rank's part of `full` along `dim` (zero padding beyond the end), with its Piece data.
    A `full` on the meta device gives a meta parameter (shapes only)."""
    start, stop, local = shard_range(full.shape[dim], tp, rank)
    shape = list(full.shape)
    shape[dim] = local
    real = [slice(None)] * full.dim()
    real[dim] = slice(0, stop - start)
    index = [slice(None)] * full.dim()
    index[dim] = slice(start, stop)
    if full.is_meta:
        t = torch.empty(shape, dtype=dtype, device="meta")
    else:
        t = torch.zeros(shape, dtype=dtype)
        t[tuple(real)] = full[tuple(index)].to(dtype)
        t = t.to(device)
    p = nn.Parameter(t)
    p.tp_index, p.tp_rows, p.tp_full_shape = tuple(index), tuple(real), tuple(full.shape)
    return p


class ColumnParallelLinear(nn.Module):
    def __init__(self, full_weight: torch.Tensor, group, sequence_parallel: bool = False, enter: bool = True,
                 label: str = "tp.column", dtype=torch.float32, device="cpu"):
        super().__init__()
        self.group, self.sp, self.enter, self.label = group, sequence_parallel, enter, label
        self.weight = sharded_parameter(full_weight, 0, group.size, group.rank, dtype, device)

    def forward(self, x):
        if self.enter:
            x = enter_tp(x, self.group, self.sp, self.label)
        return nn.functional.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    def __init__(self, full_weight: torch.Tensor, group, sequence_parallel: bool = False, exit_: bool = True,
                 label: str = "tp.row", dtype=torch.float32, device="cpu"):
        super().__init__()
        self.group, self.sp, self.exit, self.label = group, sequence_parallel, exit_, label
        self.weight = sharded_parameter(full_weight, 1, group.size, group.rank, dtype, device)

    def forward(self, x):
        y = nn.functional.linear(x, self.weight)
        return exit_tp(y, self.group, self.sp, self.label) if self.exit else y
