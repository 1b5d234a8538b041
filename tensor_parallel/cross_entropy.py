"""Cross-entropy over vocabulary-parallel logits that never gathers them (Shoeybi et al.
2019, "Megatron-LM", section 3, "fuse the output layer with the cross-entropy loss").

Each rank holds the logits of its vocabulary slice, (tokens, V/t). The loss of a token is
log Σ_v exp(z_v − m) − (z_target − m), with m the max logit; three reductions over the TP
group give it: the max (all-reduce MAX), the sum of exponentials (SUM) and the target's
logit, which only the rank owning the target contributes (SUM). Columns of the padded
vocabulary are set to −inf first, so they add exp(−inf) = 0 and never change the loss.
Backward is local: softmax − one-hot on each rank's columns. Computed in at least float32.
"""
from __future__ import annotations

import torch

from collectives import ReduceOp

from .layers import shard_range


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, real, group, label):
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
        if real < z.shape[-1]:
            z[:, real:] = float("-inf")
        m = z.max(dim=-1).values
        group.all_reduce(m, op=ReduceOp.MAX, label=f"{label}.max")
        z -= m.unsqueeze(-1)
        local = target - start
        mine = (local >= 0) & (local < real)
        idx = torch.where(mine, local, torch.zeros_like(local))
        picked = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * mine.to(z.dtype)
        group.all_reduce(picked, op=ReduceOp.SUM, label=f"{label}.target")
        z.exp_()
        total = z.sum(dim=-1)
        group.all_reduce(total, op=ReduceOp.SUM, label=f"{label}.sumexp")
        z /= total.unsqueeze(-1)  # softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(z, idx, mine)
        ctx.in_dtype = logits.dtype
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, mine = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g *= grad.unsqueeze(-1)
        return g.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, start: int, real: int, group, label: str = "tp.xent"):
    """Per-token losses from (tokens, V/t) logits of vocabulary columns [start, start + real)
    (the rest of the local columns are padding) and global target ids."""
    return _VocabParallelCrossEntropy.apply(logits, target, start, real, group, label)


class VocabParallelCrossEntropy(torch.nn.Module):
    """The mean over all tokens of `vocab_parallel_cross_entropy`: the loss module that
    replaces the reference's when the head is column-parallel over the vocabulary."""

    def __init__(self, vocab_size: int, group, label: str = "tp.xent"):
        super().__init__()
        self.group, self.label = group, label
        self.start, stop, _ = shard_range(vocab_size, group.size, group.rank)
        self.real = stop - self.start

    def forward(self, logits, targets):
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), self.start, self.real,
                                            self.group, self.label).mean()
