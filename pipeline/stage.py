"""Stage partitioning of the reference GPT for pipeline parallelism (Huang et al. 2019,
"GPipe"; Narayanan et al. 2021): a stage holds a contiguous range of the blocks; the
first stage also the embedding, the last the final norm, the head and the loss.
Parameter names are the reference names (`blocks.5.attn.wq.weight` on whichever stage
holds block 5), each parameter whole on exactly one stage (Contract 4), initialised from
(seed, name) like the reference.

With a tensor-parallel group the stage is built from Megatron's parallel layers instead
(tensor_parallel.model.Parts: a composition, so this strategy imports that one), each
weight the TP rank's slice; with sequence parallelism the activations passed between
stages are the rank's slice of the sequence.
"""
from __future__ import annotations

import torch
from torch import nn

from model.config import GPTConfig
from model.gpt import Block, RMSNorm, lm_loss, rope_tables
from model.init import init_full_parameter
from tensor_parallel.model import Parts


def partition(n_layers: int, n_stages: int, sizes=None) -> list:
    """[(first block, end)] per stage: even, or the given numbers of blocks per stage."""
    if sizes is None:
        if n_layers % n_stages:
            raise ValueError(f"n_layers={n_layers} does not split evenly over {n_stages} stages; give the blocks "
                             f"per stage (sizes) or a stage count that divides it")
        sizes = [n_layers // n_stages] * n_stages
    sizes = list(sizes)
    if len(sizes) != n_stages or sum(sizes) != n_layers or min(sizes) < 0:
        raise ValueError(f"stage sizes {sizes} must be {n_stages} non-negative counts summing to n_layers={n_layers}")
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


class PipelineStage(nn.Module):
    def __init__(self, config: GPTConfig, blocks: tuple, first: bool, last: bool, seed: int = 0,
                 dtype=torch.float32, device="cpu", tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        c = self.config = config
        self.first, self.last = first, last
        self.parts = Parts(c, tp_group, sequence_parallel, seed, dtype, device) if tp_group is not None else None
        if self.parts is not None:
            if first:
                self.tok_emb = self.parts.embedding()
            self.blocks = nn.ModuleDict({str(i): self.parts.block(i) for i in range(*blocks)})
            if last:
                self.norm, self.lm_head = self.parts.norm(), self.parts.head()
        else:
            with torch.device(device):
                if first:
                    self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
                self.blocks = nn.ModuleDict({str(i): Block(c) for i in range(*blocks)})
                if last:
                    self.norm = RMSNorm(c.d_model, c.norm_eps)
                    self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
            self.to(dtype)
            with torch.no_grad():
                for name, p in self.named_parameters():
                    p.copy_(init_full_parameter(name, p.shape, c, seed))
        cos, sin = rope_tables(c.seq_len, c.head_dim, c.rope_base, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def hidden_shape(self, tokens) -> tuple:
        """The shape of the activations this stage receives for a microbatch of `tokens`."""
        b, s = tokens.shape
        if self.parts is not None and self.parts.sp:
            s //= self.parts.group.size
        return (b, s, self.config.d_model)

    def forward(self, x, targets=None):
        """Tokens (first stage) or hidden states in; hidden states out, or on the last
        stage the mean cross-entropy of the microbatch."""
        if self.first:
            x = self.tok_emb(x)
        for block in self.blocks.values():
            x = block(x, self.rope_cos, self.rope_sin)
        if not self.last:
            return x
        logits = self.lm_head(self.norm(x))
        return self.parts.loss(logits, targets, self.lm_head) if self.parts is not None else lm_loss(logits, targets)
