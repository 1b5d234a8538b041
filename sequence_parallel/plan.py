"""Context parallelism as a transform of the reference GPT (a whole model or a pipeline
stage, maybe already tensor-parallel): every block's attention core is swapped for ring
attention or Ulysses over the context-parallel group, and the model is told the global
positions of the tokens it holds (RoPE follows them). The tokens and targets themselves
are cut by `shard_sequence` with the same positions. Parameters stay whole: they are
replicated across cp, and their gradients are averaged over dp × cp with the data
parallelism's (docs/architecture.md, "Composition").
"""
from __future__ import annotations

import torch

from .balance import IMPLEMENTATIONS, check_sequence, positions
from .ring import RingAttention
from .ulysses import UlyssesAttention


def parallelize_context(model, group, impl: str = "ring", balance: str = "zigzag"):
    """Swap every block's attention core over `group`; returns the model."""
    cp, seq = group.size, model.config.seq_len
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"cp implementation {impl!r}: choose one of {IMPLEMENTATIONS}")
    check_sequence(seq, cp, balance)
    model.positions = torch.tensor(positions(seq, cp, group.rank, balance))
    gathered = None
    if impl == "ulysses" and balance != "contiguous":
        gathered = torch.tensor([p for r in range(cp) for p in positions(seq, cp, r, balance)])
    for i, block in model.blocks.items():
        kv_heads = block.attn.wk.weight.shape[0] // block.attn.head_dim  # on this rank
        if impl == "ulysses" and kv_heads % cp:
            raise ValueError(f"Ulysses: block {i} holds {kv_heads} key/value heads on this rank, not divisible "
                             f"by cp={cp}")
        block.attn.core = RingAttention(group, balance) if impl == "ring" else UlyssesAttention(group, gathered)
    return model


def shard_sequence(x, model_positions):
    """This rank's tokens (or targets) of a (batch, seq) tensor, in the model's order."""
    return x[:, model_positions.to(x.device)]
