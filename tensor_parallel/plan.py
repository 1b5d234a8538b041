"""Megatron tensor parallelism as module swaps on the reference GPT (Shoeybi et al. 2019;
Korthikanti et al. 2022 for sequence parallelism), in the style of torchtitan's
`parallelize_module` plans: the plan names, for each module of the reference, the
parallel module that replaces it; the skeleton (blocks, norms, residuals, the forward
code) stays the reference's.

- attention: q, k, v column-parallel (split by heads) behind one f, applied by a forward
  pre-hook on the attention; the output projection row-parallel, ending in g;
- MLP: gate and up column-parallel behind one f, down row-parallel ending in g;
- MoE blocks (with sequence parallelism only): the experts stay whole, each TP rank routing
  its slice of the sequence; the router's weight enters through f (its gradient summed), and
  so do the shared experts' (whole on every TP rank, each applying them to its slice: no
  activation crosses the TP group for them, only their gradients are summed);
- embedding: vocabulary-parallel (ending in g); head: column-parallel over the vocabulary
  (f before it); loss: the vocabulary-parallel cross-entropy, so the logits are never
  gathered.

So each block does one all-reduce forward (g) and one backward (f) for attention, and one
each for the MLP. With sequence parallelism the residual stream, the norms and the
residual adds hold (batch, seq/t, hidden): f becomes an all-gather along the sequence and
g a reduce-scatter; each rank's norms then see part of the sequence, so their weights'
gradients are partial: each norm is swapped for one that applies f to its weight, so the
weight's gradient is all-reduced over the TP group (`tp.sp_norm_grads`).

Works on a whole or pruned (pipeline stage) model, on the meta device or materialized.
"""
from __future__ import annotations

from torch import nn

from model.gpt import RMSNorm, rms_norm
from model.moe import MoE

from .cross_entropy import VocabParallelCrossEntropy
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .mappings import copy_to_tp, enter_tp
from .rules import problem


def _labels(part: str, sp: bool) -> tuple[str, str]:
    return (f"tp.{part}.sp_gather", f"tp.{part}.sp_scatter") if sp else (f"tp.{part}.f", f"tp.{part}.g")


def _enter_before(module, group, sp: bool, label: str) -> None:
    """f (or the sequence all-gather) on the module's first input, as a forward pre-hook."""
    module.register_forward_pre_hook(lambda m, args: (enter_tp(args[0], group, sp, label),) + tuple(args[1:]))


class SequenceParallelRouter(nn.Module):
    """An MoE layer's router under sequence parallelism: each TP rank routes its slice of the
    sequence, so the weight enters through f and its partial gradients are summed."""

    def __init__(self, router: nn.Linear, group):
        super().__init__()
        self.weight, self.group = router.weight, group

    def forward(self, x):
        return nn.functional.linear(x, copy_to_tp(self.weight, self.group, "tp.sp_router_grads"))


class SequenceParallelSharedExperts(nn.Module):
    """An MoE layer's shared experts (a SwiGLU) under sequence parallelism: whole on each TP
    rank, applied to its slice of the sequence, so their weights enter through f and their
    partial gradients are summed, as the router's."""

    def __init__(self, mlp: nn.Module, group):
        super().__init__()
        self.w_gate, self.w_up, self.w_down, self.group = mlp.w_gate, mlp.w_up, mlp.w_down, group

    def forward(self, x):
        gate, up, down = (copy_to_tp(m.weight, self.group, "tp.sp_shared_grads")
                          for m in (self.w_gate, self.w_up, self.w_down))
        return nn.functional.linear(nn.functional.silu(nn.functional.linear(x, gate)) * nn.functional.linear(x, up),
                                    down)


class SequenceParallelRMSNorm(RMSNorm):
    """The reference RMSNorm over a slice of the sequence: its weight enters through f, so
    the partial gradients of the TP ranks are summed (all-reduce backward)."""

    def __init__(self, norm: RMSNorm, group):
        nn.Module.__init__(self)
        self.eps, self.weight, self.group = norm.eps, norm.weight, group

    def forward(self, x):
        return rms_norm(x, copy_to_tp(self.weight, self.group, "tp.sp_norm_grads"), self.eps)


def check_tensor_parallel(config, tp: int, sequence_parallel: bool) -> None:
    """Raise ValueError where the model does not split over `tp` (rules.problem)."""
    found = problem(config, tp, sequence_parallel)
    if found:
        raise ValueError(f"tensor parallelism: {found}")


def parallelize_tensor(model, group, sequence_parallel: bool = False):
    """Swap the reference GPT's modules for Megatron's over `group`; returns the model."""
    sp, t = sequence_parallel, group.size
    check_tensor_parallel(model.config, t, sp)
    if model.tok_emb is not None:
        model.tok_emb = VocabParallelEmbedding.from_reference(
            model.tok_emb, "tok_emb", group, sp, label=_labels("embed", sp)[1])
    for i, block in model.blocks.items():
        prefix = f"blocks.{i}."
        moe = isinstance(block.mlp, MoE)
        if moe:
            if not sp:
                raise ValueError("tensor parallelism of MoE blocks needs sequence parallelism: each TP rank routes "
                                 "its slice of the sequence (the tokens are not duplicated before dispatch)")
            block.mlp.router = SequenceParallelRouter(block.mlp.router, group)  # experts stay whole
            if block.mlp.shared is not None:
                block.mlp.shared = SequenceParallelSharedExperts(block.mlp.shared, group)
        for part, module, columns, row in (("attn", block.attn, ("wq", "wk", "wv"), "wo"),
                                           ("mlp", block.mlp, ("w_gate", "w_up"), "w_down"))[:1 if moe else 2]:
            enter_label, exit_label = _labels(part, sp)
            for name in columns:
                setattr(module, name, ColumnParallelLinear.from_reference(
                    getattr(module, name), f"{prefix}{part}.{name}", group, sp, enter=False))
            setattr(module, row, RowParallelLinear.from_reference(
                getattr(module, row), f"{prefix}{part}.{row}", group, sp, label=exit_label))
            _enter_before(module, group, sp, enter_label)
        block.attn.n_heads //= t
        if sp:
            block.attn_norm = SequenceParallelRMSNorm(block.attn_norm, group)
            block.mlp_norm = SequenceParallelRMSNorm(block.mlp_norm, group)
    if model.lm_head is not None:
        if sp:
            model.norm = SequenceParallelRMSNorm(model.norm, group)
        model.lm_head = ColumnParallelLinear.from_reference(model.lm_head, "lm_head", group, sp,
                                                            label=_labels("head", sp)[0])
        model.loss = VocabParallelCrossEntropy(model.config.vocab_size, group)
    return model


