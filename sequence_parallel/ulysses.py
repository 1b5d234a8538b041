"""DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for
Enabling Training of Extreme Long Sequence Transformer Models").

q, k and v arrive sharded along the sequence, (batch, heads, s/cp, head dim) on each
context-parallel rank. One all-to-all each turns them into head-sharded tensors of the
whole sequence, (batch, heads/cp, s, head dim): rank j receives head group j of every
rank's slice. Attention then runs on full sequences, for a cp-th of the heads, and one
all-to-all turns the output back into sequence shards. Backward is the transposed
all-to-all of each. So a layer does 4 all-to-alls of b·(s/cp)·h elements forward and 4
backward, (cp − 1)/cp of each leaving the rank (`cp.ulysses.q|k|v|out`); heads must be
divisible by cp.

The gathered sequence is in the ranks' order, which under zig-zag balance is not the
natural order: it is permuted to natural order for the causal attention and back.
"""
from __future__ import annotations

import torch
from torch import nn

from model.gpt import causal_attention


def _seq_to_heads(x, group, label):
    """(b, h, s_l, d) sequence-sharded -> (b, h/n, n·s_l, d) head-sharded (rank order)."""
    b, h, s, d = x.shape
    n = group.size
    inp = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # slot j goes to rank j
    out = torch.empty_like(inp)
    group.all_to_all(out, inp, label=label)  # slot j: rank j's slice of my heads
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(y, group, label):
    """The inverse: (b, h/n, n·s_l, d) -> (b, h, s_l, d)."""
    b, hn, ns, d = y.shape
    n = group.size
    inp = y.reshape(b, hn, n, ns // n, d).permute(2, 0, 1, 3, 4).contiguous()  # slot j: rank j's slice
    out = torch.empty_like(inp)
    group.all_to_all(out, inp, label=label)  # slot j: head group j of my slice
    return out.transpose(0, 1).reshape(b, n * hn, ns // n, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return _seq_to_heads(x, group, label)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g, ctx.group, ctx.label), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, label):
        ctx.group, ctx.label = group, label
        return _heads_to_seq(y, group, label)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g, ctx.group, ctx.label), None, None


def ulysses_attention(q, k, v, group, gathered_positions=None):
    """Causal attention over the whole sequence from sequence-sharded q, k, v; returns the
    output sharded like q. `gathered_positions`: the global position of each token of the
    gathered sequence (all ranks' slices in rank order), when that is not 0..s-1."""
    q, k, v = (_SeqToHeads.apply(t, group, f"cp.ulysses.{name}") for t, name in ((q, "q"), (k, "k"), (v, "v")))
    if gathered_positions is not None:
        order = torch.argsort(gathered_positions).to(q.device)  # natural order
        q, k, v = q[:, :, order], k[:, :, order], v[:, :, order]
    y = causal_attention(q, k, v)
    if gathered_positions is not None:
        y = y[:, :, gathered_positions.to(y.device)]  # back to the ranks' order
    return _HeadsToSeq.apply(y, group, "cp.ulysses.out")


class UlyssesAttention(nn.Module):
    """The attention core of a block under Ulysses context parallelism."""

    def __init__(self, group, gathered_positions=None):
        super().__init__()
        self.group, self.gathered_positions = group, gathered_positions

    def forward(self, q, k, v):
        return ulysses_attention(q, k, v, self.group, self.gathered_positions)
