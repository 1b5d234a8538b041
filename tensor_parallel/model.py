"""The reference GPT split by Megatron tensor parallelism, with optional sequence
parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022).

The blocks reuse the reference modules' forward code with their linear layers replaced:
attention split by heads (q, k, v column-parallel behind one f; the output projection
row-parallel, ending in g), the SwiGLU MLP with gate and up column-parallel behind one f
and down row-parallel. So each block does one all-reduce forward (g) and one backward (f)
for attention, and one each for the MLP. The embedding is vocabulary-parallel, the head
column-parallel over the vocabulary, and the loss the vocabulary-parallel cross-entropy:
the full logits are never gathered.

With sequence parallelism the residual stream, the norms and the residual adds hold
(batch, seq/t, hidden): f becomes an all-gather along the sequence and g a
reduce-scatter. Each rank then sees part of the sequence in the norms, so the norm
weights' gradients are partial: a hook all-reduces them over the TP group
(`tp.sp_norm_grads`) as each is computed.

Parameter names are the reference names; each weight's `tp_index` says which slice of
the reference parameter it holds (Contract 4); norm weights are whole and replicated.
"""
from __future__ import annotations

import torch
from torch import nn

from model.config import GPTConfig
from model.gpt import Attention, Block, RMSNorm, SwiGLU, rope_tables
from model.init import init_full_parameter

from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .mappings import _all_reduce, enter_tp


def _labels(part: str, sp: bool) -> tuple[str, str]:
    return (f"tp.{part}.sp_gather", f"tp.{part}.sp_scatter") if sp else (f"tp.{part}.f", f"tp.{part}.g")


class ParallelAttention(Attention):
    def __init__(self, c: GPTConfig, full, prefix: str, group, sp: bool, **kw):
        nn.Module.__init__(self)
        self.group, self.sp = group, sp
        self.n_heads, self.head_dim = c.n_heads // group.size, c.head_dim
        self.enter_label, exit_label = _labels("attn", sp)
        d = c.d_model
        for name in ("wq", "wk", "wv"):
            setattr(self, name, ColumnParallelLinear(full(f"{prefix}{name}.weight", (d, d)), group, sp, enter=False, **kw))
        self.wo = RowParallelLinear(full(f"{prefix}wo.weight", (d, d)), group, sp, label=exit_label, **kw)

    def forward(self, x, cos, sin):
        return super().forward(enter_tp(x, self.group, self.sp, self.enter_label), cos, sin)


class ParallelSwiGLU(SwiGLU):
    def __init__(self, c: GPTConfig, full, prefix: str, group, sp: bool, **kw):
        nn.Module.__init__(self)
        self.group, self.sp = group, sp
        self.enter_label, exit_label = _labels("mlp", sp)
        d, f = c.d_model, c.d_ff
        self.w_gate = ColumnParallelLinear(full(f"{prefix}w_gate.weight", (f, d)), group, sp, enter=False, **kw)
        self.w_up = ColumnParallelLinear(full(f"{prefix}w_up.weight", (f, d)), group, sp, enter=False, **kw)
        self.w_down = RowParallelLinear(full(f"{prefix}w_down.weight", (d, f)), group, sp, label=exit_label, **kw)

    def forward(self, x):
        return super().forward(enter_tp(x, self.group, self.sp, self.enter_label))


class ParallelBlock(Block):
    def __init__(self, c: GPTConfig, full, prefix: str, group, sp: bool, **kw):
        nn.Module.__init__(self)
        self.attn_norm = _norm(c, group, sp, **kw)
        self.attn = ParallelAttention(c, full, f"{prefix}attn.", group, sp, **kw)
        self.mlp_norm = _norm(c, group, sp, **kw)
        self.mlp = ParallelSwiGLU(c, full, f"{prefix}mlp.", group, sp, **kw)


def _norm(c: GPTConfig, group, sp: bool, dtype, device) -> RMSNorm:
    with torch.device(device):
        norm = RMSNorm(c.d_model, c.norm_eps).to(dtype)  # ones: the reference init of norm weights
    if sp:  # each rank normalised its part of the sequence: sum the partial weight gradients
        norm.weight.register_hook(lambda g: _all_reduce(g, group, "tp.sp_norm_grads"))
    return norm


class Parts:
    """Builds the tensor-parallel layers of the reference GPT by their reference names, each
    weight the TP rank's slice of the full reference parameter: all of them for
    `ParallelGPT`, a stage's share for a pipeline (pipeline/stage.py)."""

    def __init__(self, config: GPTConfig, group, sequence_parallel: bool = False, seed: int = 0,
                 dtype=torch.float32, device="cpu"):
        c = self.config = config
        if sequence_parallel and c.seq_len % group.size:
            raise ValueError(f"sequence parallelism: seq_len={c.seq_len} is not divisible by tp={group.size}")
        self.group, self.sp, self.seed, self.device = group, sequence_parallel, seed, device
        self.kw = {"dtype": dtype, "device": device}

    def full(self, name, shape):
        if str(self.device) == "meta":
            return torch.empty(shape, device="meta")
        return init_full_parameter(name, shape, self.config, self.seed)

    def embedding(self) -> VocabParallelEmbedding:
        c = self.config
        return VocabParallelEmbedding(self.full("tok_emb.weight", (c.vocab_size, c.d_model)), self.group, self.sp,
                                      label="tp.embed.sp_scatter" if self.sp else "tp.embed.g", **self.kw)

    def block(self, i: int) -> ParallelBlock:
        return ParallelBlock(self.config, self.full, f"blocks.{i}.", self.group, self.sp, **self.kw)

    def norm(self) -> RMSNorm:
        return _norm(self.config, self.group, self.sp, **self.kw)

    def head(self) -> ColumnParallelLinear:
        c = self.config
        return ColumnParallelLinear(self.full("lm_head.weight", (c.vocab_size, c.d_model)), self.group, self.sp,
                                    label=_labels("head", self.sp)[0], **self.kw)

    def loss(self, logits, targets, head: ColumnParallelLinear):
        """The mean cross-entropy over all tokens from the head's vocabulary-parallel logits."""
        start = head.weight.tp_index[0].start
        real = head.weight.tp_index[0].stop - start
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.flatten(), start, real, self.group).mean()


class ParallelGPT(nn.Module):
    def __init__(self, config: GPTConfig, group, sequence_parallel: bool = False, seed: int = 0,
                 dtype=torch.float32, device="cpu"):
        super().__init__()
        c = self.config = config
        self.group, self.sp = group, sequence_parallel
        self.parts = parts = Parts(config, group, sequence_parallel, seed, dtype, device)
        self.tok_emb = parts.embedding()
        self.blocks = nn.ModuleList(parts.block(i) for i in range(c.n_layers))
        self.norm = parts.norm()
        self.lm_head = parts.head()
        cos, sin = rope_tables(c.seq_len, c.head_dim, c.rope_base, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens, targets=None):
        """Vocabulary-parallel logits (batch, seq, V/t, padded); with targets, the mean
        cross-entropy over all tokens (the same value on every TP rank)."""
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return self.parts.loss(logits, targets, self.lm_head)
