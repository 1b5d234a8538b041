"""The reference GPT (unsharded): a decoder-only transformer in today's style.

RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021), causal
attention through `scaled_dot_product_attention`, a SwiGLU MLP (Shazeer 2020) or, in MoE
blocks, a router and SwiGLU experts (moe.py), pre-norm residual blocks and an untied LM
head. Parameter names are the reference names that
every strategy maps its shards to (`blocks.3.attn.wq.weight`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .compiled import as_dtype, fused_on
from .config import GPTConfig
from .dropout import dropout, dropout_generator, seed_dropout
from .regions import fused_kernel
from .init import init_weights
from .moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x, weight, eps: float):
    """x / rms(x) · weight, computed in at least float32 (as LLaMA does: in fp16 the squares'
    mean and its rsqrt lose too much) and returned in x's dtype. On CUDA torch's
    `F.rms_norm`: one fused kernel forward, one backward. Elsewhere (the CPU ranks, and the
    meta device a plan runs on) `FusedRMSNorm`, the same arithmetic op by op, which the
    simulator prices as those fused kernels."""
    if x.is_cuda:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return FusedRMSNorm.apply(x, weight, eps)


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as torch's fused CUDA kernels compute and keep it: forward reads x and the
    weight and writes y, keeping x and the float32 reciprocal rms r for backward; backward
    is one kernel writing dx = r·(dn − n·mean(dn·n)) (n = x·r, dn = dy·w) and one reduction
    to dw = Σ dy·n. The arithmetic runs op by op here, each pass priced as one kernel."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        with fused_kernel(2 * x.nbytes + weight.nbytes + h[..., :1].nbytes, "_fused_rms_norm"):
            r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            y = as_dtype(h * r * weight.to(h.dtype), x.dtype)
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        dw = None
        with fused_kernel(3 * x.nbytes + weight.nbytes + r.nbytes, "_fused_rms_norm_backward"):
            h = x.to(r.dtype)
            n, g = h * r, dy.to(r.dtype)
            dn = g * weight.to(r.dtype)
            dx = as_dtype(r * (dn - n * (dn * n).mean(-1, keepdim=True)), x.dtype)
        if ctx.needs_input_grad[1]:
            with fused_kernel(2 * x.nbytes + r.nbytes + weight.nbytes, "_fused_rms_norm_backward"):
                dw = as_dtype((g * n).flatten(0, -2).sum(0), weight.dtype)
        return dx, dw, None


def rope_tables(seq_len: int, head_dim: int, base: float, dtype, device):
    """The rotary tables (seq_len, head_dim): cos of each pair's angle in both halves, and
    its sin with the first half negated, so that rotating x is x·cos + roll(x)·sin."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    cos, sin = angles.cos(), angles.sin()
    return (torch.cat((cos, cos), -1).to(dtype=dtype, device=device),
            torch.cat((-sin, sin), -1).to(dtype=dtype, device=device))


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x (batch, seq, heads, head_dim) by the
    tables' rows (seq, head_dim): (x1·cos − x2·sin, x2·cos + x1·sin), as x·cos +
    roll(x)·sin, where roll(x) = (x2, x1): four kernels each way instead of a cat of two
    halves each built from two products."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, -1) * sin[:, None]


def expand_kv(k, n_heads: int):
    """Grouped-query attention: each key/value head serves n_heads / kv_heads query heads
    (adjacent ones), so it is repeated that many times along the head dimension."""
    groups = n_heads // k.shape[1]
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def causal_attention(q, k, v):
    """Causal scaled dot-product attention over (batch, heads, seq, head_dim), k and v
    with the same heads as q or fewer (grouped-query attention). On the meta
    device (planning, shapes only) the fused kernel is named explicitly: meta tensors would
    otherwise take the math fallback, which keeps the seq² probabilities for backward, where
    every real run uses a flash kernel that keeps the log-sum-exp."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    if q.is_meta:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
    if q.dtype == torch.float64 and not q.is_cuda and torch.compiler.is_compiling():
        return _eager_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@torch.compiler.disable
def _eager_attention(q, k, v):
    """The CPU's flash kernel in float64 run eagerly, outside a graph torch.compile traces:
    Inductor (torch 2.11 and 2.12) gives its backward a float32 log-sum-exp, which the kernel
    refuses ("expected scalar type Double but found Float"), so `check --compile` in float64
    failed there. A graph break around one kernel the CPU runs the same either way."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _causal_softmax(scores, scale: float):
    """softmax(scale · scores) with each query's future masked out, in at least float32,
    returned in the scores' dtype."""
    s = scores.shape[-1]
    i = torch.arange(s, device=scores.device)
    h = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    return as_dtype(torch.softmax(h.masked_fill(i[None, :] > i[:, None], float("-inf")), dim=-1), scores.dtype)


def _causal_softmax_backward(p, g, scale: float):
    """The scores' gradient of `_causal_softmax`: scale · p · (g − Σ g·p)."""
    wide = torch.promote_types(p.dtype, torch.float32)
    pf, gf = p.to(wide), g.to(wide)
    return as_dtype(scale * pf * (gf - (gf * pf).sum(-1, keepdim=True)), p.dtype)


class ScaledCausalSoftmax(torch.autograd.Function):
    """softmax(scale · scores) over each query's past (the future masked out), as
    Megatron-LM's fused scale-mask-softmax kernel for causal masks computes it (Narayanan et
    al. 2021, section 4, computation optimizations: custom kernels fusing the scale, the
    mask and the softmax, one of them with the causal mask implicit): forward one kernel
    reading the scores and writing the probabilities, kept for backward; backward one
    kernel reading them and the output gradient and writing the scores' gradient. In
    float32 inside, returned in the scores' dtype. On CUDA each way is compiled (one fused
    kernel, as theirs); elsewhere the arithmetic runs op by op, each way priced as one
    kernel."""

    @staticmethod
    def forward(ctx, scores, scale: float):
        with fused_kernel(2 * scores.nbytes, "_fused_scale_mask_softmax"):
            p = fused_on(_causal_softmax, scores)(scores, scale)
        ctx.save_for_backward(p)
        ctx.scale = scale
        return p

    @staticmethod
    def backward(ctx, g):
        p, = ctx.saved_tensors
        with fused_kernel(3 * p.nbytes, "_fused_scale_mask_softmax_backward"):
            d = fused_on(_causal_softmax_backward, p)(p, g, ctx.scale)
        return d, None


def unfused_attention(q, k, v, dropout_rate: float = 0.0, generator=None, training: bool = True):
    """Causal attention as Megatron-LM ran it before FlashAttention (Narayanan et al. 2021):
    the scores q·kᵀ of every (query, key) pair by a batched matmul, written to memory
    (batch, heads, s, s); the fused scale-mask-softmax (`ScaledCausalSoftmax`); dropout on
    the probabilities (model/dropout.py: its own kernel, `--attention-dropout` there); the
    probabilities times v. Both matmuls compute the full s×s, the masked half included."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    p = ScaledCausalSoftmax.apply(q @ k.transpose(-2, -1), q.shape[-1] ** -0.5)
    return dropout(p, dropout_rate, generator, training) @ v


class CausalAttention(nn.Module):
    """The attention itself, on (batch, heads, seq, head_dim) q, k, v of the whole
    sequence: a module without parameters, so that context parallelism can swap it for
    ring attention or Ulysses. With attention dropout (unfused attention only), the
    generator its masks come from (model/dropout.py; set when the model gets storage)."""

    def __init__(self, kernel: str = "flash", dropout_rate: float = 0.0):
        super().__init__()
        self.kernel, self.dropout_rate = kernel, dropout_rate
        self.generator = None

    def forward(self, q, k, v):
        if self.kernel == "unfused":
            return unfused_attention(q, k, v, self.dropout_rate, self.generator, self.training)
        return causal_attention(q, k, v)  # (flash1 too: the same kernel here, priced as FlashAttention-1's)


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_heads, self.head_dim = c.n_heads, c.head_dim
        self.wq = nn.Linear(c.d_model, c.d_model, bias=False)
        self.wk = nn.Linear(c.d_model, c.kv_dim, bias=False)
        self.wv = nn.Linear(c.d_model, c.kv_dim, bias=False)
        self.wo = nn.Linear(c.d_model, c.d_model, bias=False)
        self.core = CausalAttention(c.attention, c.attention_dropout)

    def forward(self, x, cos, sin):
        """cos, sin: the rotary tables of the positions of x's tokens (the first s rows). The
        core gets k and v with their own (kv) heads: it expands them to the query heads."""
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        # rotated in (batch, seq, heads, head_dim) order: the attention kernel then writes its
        # output in that order too, and the transpose back below is free (no copy)
        q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, c: GPTConfig, width: int = 0):
        """width: the hidden width (0: c.d_ff)."""
        super().__init__()
        f = width or c.d_ff
        self.w_gate = nn.Linear(c.d_model, f, bias=False)
        self.w_up = nn.Linear(c.d_model, f, bias=False)
        self.w_down = nn.Linear(f, c.d_model, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, c: GPTConfig, moe: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.d_model, c.norm_eps)
        shared = SwiGLU(c, c.n_shared_experts * c.expert_width) if moe and c.n_shared_experts else None
        self.mlp = MoE(c, shared) if moe else SwiGLU(c)
        # activation checkpointing (activation_checkpointing.Recompute): runs `body` so that
        # backward recomputes what forward did not keep; None: plain forward
        self.recompute = None

    def forward(self, x, cos, sin):
        if self.recompute is not None:
            return self.recompute(self.body, x, cos, sin)
        return self.body(x, cos, sin)

    def body(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class CrossEntropy(nn.Module):
    """The loss of the reference: mean cross-entropy over all tokens (a module, so that a
    strategy can swap it: tensor parallelism puts its vocabulary-parallel loss here)."""

    def forward(self, logits, targets):
        return lm_loss(logits, targets)


class GPT(nn.Module):
    """The reference model. Built whole; a strategy may swap its modules (tensor
    parallelism) or prune it to the modules a pipeline stage owns: `blocks` is a
    ModuleDict keyed by the block's index, so a pruned model keeps the reference names,
    and `tok_emb`, `norm` and `lm_head` may be None (forward then takes hidden states in,
    or gives them out)."""

    def __init__(self, config: GPTConfig, seed: int = 0, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.config = config
        c = config
        # Modules are made on the meta device (no memory, no random init: the weights come
        # from init_weights), then given storage on `device`. nn.Embedding's own init would
        # run normal_ on meta, whose decomposition imports torch._dynamo (seconds, with every
        # rank thread waiting on the import lock): it gets an explicit empty weight instead.
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(c.vocab_size, c.d_model, _weight=torch.empty(c.vocab_size, c.d_model))
            self.blocks = nn.ModuleDict({str(i): Block(c, c.is_moe(i)) for i in range(c.n_layers)})
            for i, block in self.blocks.items():
                if isinstance(block.mlp, MoE):
                    block.mlp.index = int(i)
            self.norm = RMSNorm(c.d_model, c.norm_eps)
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.loss = CrossEntropy()
        # the global positions of the tokens this model sees, when they are not 0..s-1
        # (context parallelism holds a permuted slice of the sequence): RoPE follows them
        self.positions = None
        self.to(dtype)
        cos, sin = rope_tables(c.seq_len, c.head_dim, c.rope_base, dtype, "meta")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if str(device) != "meta":
            self.materialize(device, seed)

    def moe_layers(self) -> list:
        """The MoE layers this model (or stage) holds."""
        return [b.mlp for b in self.blocks.values() if isinstance(b.mlp, MoE)]

    def materialize(self, device, seed: int = 0, state_dict: dict | None = None, rank: int = 0) -> "GPT":
        """Give every parameter storage on `device` and its value: the part its placement
        names of the full reference parameter generated from (seed, name) (Contract 4), so
        any layout's shards are exact slices of the same tensors. Also the RoPE tables, and
        with attention dropout each attention's generator, seeded from (seed, rank, layer).
        Moving off the meta device makes new Parameter objects: their placements are carried
        over, hooks on the old ones would be lost (transforms hook modules, not tensors)."""
        placements = {n: p.placement for n, p in self.named_parameters() if hasattr(p, "placement")}
        self.to_empty(device=device)
        for n, p in self.named_parameters():
            if n in placements:
                p.placement = placements[n]
        if str(device) != "meta":  # shapes only on meta: nothing to compute
            init_weights(self, self.config, seed, state_dict)
        dtype = next((p.dtype for p in self.parameters()), torch.float32)
        c = self.config
        if c.attention_dropout:
            for block in self.blocks.values():
                if isinstance(block.attn.core, CausalAttention):
                    block.attn.core.generator = dropout_generator(device)
            seed_dropout(self, seed, rank)
        self.rope_cos, self.rope_sin = rope_tables(c.seq_len, c.head_dim, c.rope_base, dtype, device)
        for layer in self.moe_layers():  # the balancing bias starts at zero, in at least float32
            if layer.expert_bias is not None:
                layer.expert_bias = torch.zeros(c.n_experts, dtype=torch.promote_types(dtype, torch.float32),
                                                device=device)
        return self

    def forward(self, x, targets=None):
        """Token ids (or, without an embedding, hidden states) in; logits out, or with
        targets the mean cross-entropy over all tokens; without a head, hidden states."""
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        cos, sin = self.rope_cos, self.rope_sin
        if self.positions is not None:
            index = self.positions.to(cos.device)
            cos, sin = cos[index], sin[index]
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return self.loss(logits, targets)


def lm_loss(logits, targets):
    """Mean cross-entropy over all tokens, in at least float32 (bf16/fp16 logits, as ZeRO's
    compute copies give, would round it)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
