"""The selective recomputation policy: which ops' outputs a checkpointed block keeps.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 5) keep what is expensive to recompute and cheap to store and recompute
the rest. With a fused attention kernel the s² scores are never stored, so what remains
is the op-level form torchtitan uses (its `SelectiveAC`, a policy for
`torch.utils.checkpoint.create_selective_checkpoint_contexts`): keep the outputs of the
matmuls and of the attention kernel, recompute the element-wise and normalisation ops
(RMSNorm, RoPE, SiLU and the gate product, residual adds, casts). torchtitan's own
op-level policy ("selective op", torchtitan/distributed/activation_checkpoint.py) also
recomputes every second matmul of a block (counted in each checkpointed call, apart in the
forward and in the recomputation), less memory for more recomputation: `recompute_every`
2, the mode "selective-op". The routing's sorts (the router's top-k is one:
`model.moe.top_k`) are kept too, so that recomputation routes every token as the first
forward did without sorting again. Communication is recomputed, as in
Megatron-LM's full recompute: a block's collectives run again in its backward.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten


def _packets(*names) -> set:
    """The aten overload packets among `names` that this torch build has (kernel names
    differ across versions and devices)."""
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


# matmuls, and the fused attention kernels of every backend (CUDA flash, memory-efficient,
# cuDNN; the CPU flash kernel, which the meta device also names)
KEEP = _packets("mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_flash_attention_forward", "_efficient_attention_forward",
                "sort")


def _keeps(func) -> bool:
    """Whether `func` is one whose output the policy keeps: an op of KEEP that makes its
    output, not one that writes into a tensor it is given (`out=`, in place). Inductor's code
    for a compiled region inside the block (model/compiled.py) calls its matmuls so, into
    buffers it reuses for later kernels of the region: a kept output would be overwritten
    before the recomputation takes it back (torch's checkpoint refuses it: "Tensor cached
    during selective activation checkpoint has been mutated")."""
    return func._overloadpacket in KEEP and not func._schema.is_mutable


class SelectivePolicy:
    """`policy(ctx, func, *args, **kwargs)` of one checkpointed call: MUST_SAVE for the ops in
    KEEP, PREFER_RECOMPUTE for everything else; with `recompute_every` n, also for each n-th
    matmul (aten.mm, as torchtitan counts them) of the call, counted apart in its forward
    and in its recomputation, which then decide alike (torch 2.13 replays the forward's
    decisions in the recomputation; earlier versions ask the policy again)."""

    def __init__(self, recompute_every: int | None = None):
        self.every = recompute_every
        self.matmuls = {False: 0, True: 0}  # matmuls met so far: in the forward, in the recomputation
        self.last = None  # (func, kept?) of the op decided last

    def saves(self, func) -> bool:
        """Whether the policy kept the output of `func`, the op it decided last (the memory
        tracker asks once the op has run)."""
        if self.last is not None and self.last[0] is func:
            return self.last[1]
        return _keeps(func) and not (self.every and func._overloadpacket is aten.mm)

    def __call__(self, ctx, func, *args, **kwargs):
        keep = _keeps(func)
        if keep and self.every and func._overloadpacket is aten.mm:
            self.matmuls[ctx.is_recompute] += 1
            keep = self.matmuls[ctx.is_recompute] % self.every != 0
        self.last = (func, keep)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
