"""The selective recomputation policy: which ops' outputs a checkpointed block keeps.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 5) keep what is expensive to recompute and cheap to store and recompute
the rest. With a fused attention kernel the s² scores are never stored, so what remains
is the op-level form torchtitan uses (its `SelectiveAC`, a policy for
`torch.utils.checkpoint.create_selective_checkpoint_contexts`): keep the outputs of the
matmuls and of the attention kernel, recompute the element-wise and normalisation ops
(RMSNorm, RoPE, SiLU and the gate product, residual adds, casts). The router's top-k is
kept too, so that recomputation routes every token as the first forward did (a tie
broken differently would send a token elsewhere). Communication is recomputed, as in
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
                "topk")


class SelectivePolicy:
    """`policy(ctx, func, *args, **kwargs)`: MUST_SAVE for the ops in KEEP, PREFER_RECOMPUTE
    for everything else."""

    @staticmethod
    def saves(func) -> bool:
        return func._overloadpacket in KEEP

    def __call__(self, ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if self.saves(func) else CheckpointPolicy.PREFER_RECOMPUTE
