"""The communication operators of Megatron tensor parallelism as autograd functions
(Shoeybi et al. 2019, "Megatron-LM", section 3: the conjugate f and g; Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2.2:
g and ḡ for sequence parallelism).

- `f` (copy_to_tp): identity forward, all-reduce of the gradient backward. Enters a
  tensor-parallel region whose input is replicated.
- `g` (reduce_from_tp): all-reduce forward, identity backward. Leaves it: sums the
  partial outputs of a row-parallel layer.
- `gather_seq` (sequence parallelism's g): all-gather along the sequence forward,
  reduce-scatter backward; replaces f when the residual stream is sharded along the
  sequence.
- `scatter_seq` (sequence parallelism's ḡ): reduce-scatter along the sequence forward,
  all-gather backward; replaces g.

Activations are (batch, sequence, hidden); the collectives concatenate along dim 0, so
the sequence functions move the sequence to the front (as Megatron keeps it) around the
call. Every call carries a ledger label naming the layer and the operator.
"""
from __future__ import annotations

import torch

from collectives import ReduceOp


def _all_reduce(x, group, label):
    out = x.contiguous().clone()
    group.all_reduce(out, op=ReduceOp.SUM, label=label)
    return out


def _all_gather_seq(x, group, label):
    """(b, s/t, h) on each rank -> (b, s, h), rank r's part at [r·s/t, (r+1)·s/t)."""
    part = x.transpose(0, 1).contiguous()
    out = torch.empty((part.shape[0] * group.size, *part.shape[1:]), dtype=x.dtype, device=x.device)
    group.all_gather(out, part, label=label)
    # batch-major again, once: each column-parallel matmul that reads it folds (b, s) into
    # rows, and a strided view would make each of them copy it (and keep its own copy for
    # backward: three copies of the gathered input per attention, two per MLP, when b > 1)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x, group, label):
    """(b, s, h) partial sums on each rank -> rank r gets the sum of sequence part r."""
    full = x.transpose(0, 1).contiguous()
    if full.shape[0] % group.size:
        raise ValueError(f"{label}: sequence length {full.shape[0]} is not divisible by tp={group.size}")
    out = torch.empty((full.shape[0] // group.size, *full.shape[1:]), dtype=x.dtype, device=x.device)
    group.reduce_scatter(out, full, op=ReduceOp.SUM, label=label)
    return out.transpose(0, 1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.label), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        return _all_reduce(x, group, label)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return _all_gather_seq(x, group, label)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group, ctx.label), None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return _reduce_scatter_seq(x, group, label)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group, ctx.label), None, None


def copy_to_tp(x, group, label: str):
    """f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, group, label)


def reduce_from_tp(x, group, label: str):
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group, label)


def gather_seq(x, group, label: str):
    """Sequence parallelism, entering a TP region: all-gather forward, reduce-scatter backward."""
    return _GatherSeq.apply(x, group, label)


def scatter_seq(x, group, label: str):
    """Sequence parallelism, leaving a TP region: reduce-scatter forward, all-gather backward."""
    return _ScatterSeq.apply(x, group, label)


def enter_tp(x, group, sequence_parallel: bool, label: str):
    """Into a tensor-parallel region: f, or the sequence all-gather."""
    return gather_seq(x, group, label) if sequence_parallel else copy_to_tp(x, group, label)


def exit_tp(x, group, sequence_parallel: bool, label: str):
    """Out of a tensor-parallel region: g, or the sequence reduce-scatter."""
    return scatter_seq(x, group, label) if sequence_parallel else reduce_from_tp(x, group, label)
