"""The vocabulary-parallel embedding (Shoeybi et al. 2019, "Megatron-LM", section 3):
rows of the embedding table split over the TP group, the vocabulary padded to a multiple
of tp. Each rank looks up the tokens in its range and writes zeros for the others; the
partial embeddings are summed with g (an all-reduce), or with sequence parallelism
reduce-scattered along the sequence, which leaves each rank its part of the sequence.
Padding rows are never looked up (token ids are below the real vocabulary size).
"""
from __future__ import annotations

import torch
from torch import nn

from .layers import shard_range, sharded_parameter
from .mappings import exit_tp


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: nn.Parameter, vocab_size: int, group, sequence_parallel: bool = False,
                 label: str = "tp.embed"):
        super().__init__()
        self.group, self.sp, self.label = group, sequence_parallel, label
        self.start, self.stop, self.local = shard_range(vocab_size, group.size, group.rank)
        self.weight = weight

    @classmethod
    def from_reference(cls, embedding: nn.Embedding, name: str, group, sequence_parallel=False, label="tp.embed"):
        return cls(sharded_parameter(embedding.weight, f"{name}.weight", 0, group), embedding.num_embeddings,
                   group, sequence_parallel, label)

    def forward(self, tokens):
        mine = (tokens >= self.start) & (tokens < self.stop)
        local = torch.where(mine, tokens - self.start, torch.zeros_like(tokens))
        x = nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return exit_tp(x, self.group, self.sp, self.label)
