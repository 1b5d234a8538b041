"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"; Brandon et al. 2023 for the causal load balance), written with
plain matmuls so that every op is visible to the simulator.

Each context-parallel rank holds a slice of the sequence (sequence_parallel.balance: one
chunk, or two in zig-zag). In forward, q stays; the K/V block travels around the ring
(rank r sends to r + 1 and receives from r − 1), the next block in flight while the
current one is computed (double buffering: one batched isend/irecv per step). For each
pair of a local q chunk and a visiting k chunk: a k chunk entirely in the future is
skipped, the diagonal chunk is causally masked, past chunks are attended in full. The
partial results are merged with an online softmax (Milakov & Gimelshein 2018): the
output and the log-sum-exp are kept in float32 (at least), and each merge rescales by
exp(lse − lse_new), never exponentiating raw scores.

On a GPU each block's arithmetic is one FlashAttention call (its tiles never leave the
chip): the simulator is told so (`model.regions.fused_kernel`), and charges it its
FLOPs and its inputs and outputs, not the score matrix written for clarity here.

Backward recomputes each block's probabilities from the saved log-sum-exp
(P = exp(S − lse), D = rowsum(dO ∘ O), dS = P ∘ (dP − D), as FlashAttention's backward):
dQ accumulates locally; the K/V blocks travel the ring again (cp − 1 sends) and their
gradients dK, dV accumulate in float32 and travel with them, cp sends, the last one
returning them to their owner.

Ledger per rank, layer and microbatch: forward cp − 1 sends of K/V (`cp.ring.kv`,
2·b·(s/cp)·h·e bytes each); backward cp − 1 sends of K/V (`cp.ring.kv_bwd`) and cp of
dK/dV in float32 (`cp.ring.dkv`, 2·b·(s/cp)·h·4 bytes each); h is the local key/value
width (key/value heads on this rank × head dim: with grouped-query attention the ring
carries only those, each block expanding them to the query heads).
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from collectives import P2POp
from model.compiled import as_dtype
from model.regions import fused_kernel
from model.gpt import expand_kv

from .balance import chunks_of


def _scores(q, k, causal: bool, scale: float):
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:  # the diagonal chunk: q and k hold the same positions
        c = s.shape[-1]
        s = s.masked_fill(torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def block_attention(q, k, v, causal: bool, scale: float):
    """(output, log-sum-exp) of q attending to one k/v chunk, in q's (float32+) dtype."""
    s = _scores(q, k, causal, scale)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    return (p @ v) / total, (m + total.log()).squeeze(-1)


def merge(out, lse, block_out, block_lse):
    """The online-softmax merge of a block's result into the running one."""
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new).unsqueeze(-1) + block_out * torch.exp(block_lse - new).unsqueeze(-1), new


def flash_kernels(t) -> bool:
    """Whether the blocks run on the CUDA flash-attention kernel (bf16/fp16 on CUDA): it returns
    the log-sum-exp the merge needs, and its backward takes the merged output and log-sum-exp,
    as ring backward requires (ring-flash-attention does the same). Elsewhere: plain matmuls."""
    return t.is_cuda and t.dtype in (torch.float16, torch.bfloat16)


def _flash_block(q, k, v, causal: bool, scale: float):
    """(output, log-sum-exp, the kernel's auxiliary outputs for its backward). Chunks are
    views; the kernels want dense tensors (the log-sum-exp is read without strides)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1], tuple(r[2:8])


def _flash_block_backward(dout, q, k, v, out, lse, aux, causal: bool, scale: float):
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    dout, q, k, v, out, lse = (t.contiguous() for t in (dout, q, k, v, out, lse))
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)[:3]


def _fold_kv(g, kv_heads: int):
    """The gradient of expand_kv: each key/value head gets the sum over its group of query heads."""
    b, h, c, d = g.shape
    return g if h == kv_heads else g.reshape(b, kv_heads, h // kv_heads, c, d).sum(2)


def _io(*tensors) -> int:
    """Bytes a fused kernel reads and writes: its inputs and outputs, once each."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _exchange(group, tensor, label: str):
    """Send `tensor` to the next rank of the ring, receive the previous rank's: (Works, buffer)."""
    n, r = group.size, group.rank
    buf = torch.empty_like(tensor)
    works = group.batch_isend_irecv([P2POp("isend", tensor, (r + 1) % n, label),
                                     P2POp("irecv", buf, (r - 1) % n, label)])
    return works, buf


def _pairs(rank: int, src: int, n: int, balance: str):
    """(q chunk slot, k chunk slot, causal) of the chunk pairs rank computes with src's block."""
    mine, theirs = chunks_of(rank, n, balance), chunks_of(src, n, balance)
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(theirs):
            if kc <= qc:  # a chunk entirely in the future is skipped
                yield qi, ki, kc == qc


def _exact(t):
    """Autocast off around the ring's own arithmetic (it would cast the float32 matmuls of
    the merge back to bf16); meta tensors have no autocast."""
    return contextlib.nullcontext() if t.device.type == "meta" else torch.autocast(t.device.type, enabled=False)


def ring_forward(q, k, v, group, balance: str):
    """The forward pass: (output in float32 or wider, log-sum-exp) of this rank's q."""
    with _exact(q):
        out, lse, _ = _ring_forward(q, k, v, group, balance)
        return out, lse


def _ring_forward(q, k, v, group, balance: str):
    n, r = group.size, group.rank
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    c = q.shape[2] // len(chunks_of(r, n, balance))
    qs = [x.to(acc) for x in q.split(c, dim=2)]
    out = [torch.zeros_like(x) for x in qs]
    lse = [torch.full(x.shape[:-1], float("-inf"), dtype=acc, device=x.device) for x in qs]
    flash = flash_kernels(q)
    aux = None
    qn = q.split(c, dim=2)  # the query chunks in their own dtype, for the flash kernel
    kv = torch.stack([k, v]).contiguous()
    for step in range(n):
        works, nxt = _exchange(group, kv, "cp.ring.kv") if step < n - 1 else ([], None)
        ks, vs = kv[0].split(c, dim=2), kv[1].split(c, dim=2)
        for qi, ki, causal in _pairs(r, (r - step) % n, n, balance):
            io = _io(qs[qi], ks[ki], vs[ki], out[qi], lse[qi])
            with fused_kernel(io, "flash_attention", attention=True):  # one FlashAttention call
                kb, vb = expand_kv(ks[ki], q.shape[1]), expand_kv(vs[ki], q.shape[1])  # (grouped-query attention)
                if flash:
                    o, lse_b, aux = _flash_block(qn[qi], kb, vb, causal, scale)
                    o = o.to(acc)
                else:
                    o, lse_b = block_attention(qs[qi], kb.to(acc), vb.to(acc), causal, scale)
                out[qi], lse[qi] = merge(out[qi], lse[qi], o, lse_b)
        for w in works:
            w.wait()
        kv = nxt
    return torch.cat(out, dim=2), torch.cat(lse, dim=2), aux


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, balance):
        with _exact(q):
            out, lse, ctx.flash_aux = _ring_forward(q, k, v, group, balance)
        out = as_dtype(out, q.dtype)  # (no no-op .to() returned: model/compiled.py)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balance = group, balance
        ctx.c = q.shape[2] // len(chunks_of(group.rank, group.size, balance))
        return out

    @staticmethod
    def backward(ctx, dout):
        with _exact(dout):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, balance, c = ctx.group, ctx.balance, ctx.c
        n, r = group.size, group.rank
        acc = torch.promote_types(q.dtype, torch.float32)
        scale = 1.0 / math.sqrt(q.shape[-1])
        flash = flash_kernels(q) and ctx.flash_aux is not None
        dons, qn, outs = dout.contiguous().split(c, dim=2), q.split(c, dim=2), out.split(c, dim=2)
        dout = dout.to(acc)
        delta = (dout * out.to(acc)).sum(dim=-1)
        qs, dos = [x.to(acc) for x in q.split(c, dim=2)], dout.split(c, dim=2)
        lses, deltas = lse.split(c, dim=2), delta.split(c, dim=2)
        dq = [torch.zeros_like(x) for x in qs]
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # travels with its K/V block
        for step in range(n):
            works, nxt = _exchange(group, kv, "cp.ring.kv_bwd") if step < n - 1 else ([], None)
            ks, vs = kv[0].split(c, dim=2), kv[1].split(c, dim=2)
            dks, dvs = dkv[0].split(c, dim=2), dkv[1].split(c, dim=2)
            for qi, ki, causal in _pairs(r, (r - step) % n, n, balance):
                H, kvh = q.shape[1], k.shape[1]
                if flash:
                    dqb, dkb, dvb = _flash_block_backward(dons[qi], qn[qi], expand_kv(ks[ki], H), expand_kv(vs[ki], H),
                                                          outs[qi], lses[qi], ctx.flash_aux, causal, scale)
                    dq[qi].add_(dqb)
                    dks[ki].add_(_fold_kv(dkb.to(acc), kvh))
                    dvs[ki].add_(_fold_kv(dvb.to(acc), kvh))
                    continue
                io = _io(qs[qi], ks[ki], vs[ki], dos[qi], lses[qi], dq[qi], dks[ki], dvs[ki])
                with fused_kernel(io, "flash_attention", attention=True):
                    kb, vb = expand_kv(ks[ki], H).to(acc), expand_kv(vs[ki], H).to(acc)
                    p = torch.exp(_scores(qs[qi], kb, causal, scale) - lses[qi].unsqueeze(-1))
                    dvs[ki].add_(_fold_kv(p.transpose(-1, -2) @ dos[qi], kvh))
                    ds = p * (dos[qi] @ vb.transpose(-1, -2) - deltas[qi].unsqueeze(-1))
                    dq[qi].add_((ds @ kb) * scale)
                    dks[ki].add_(_fold_kv((ds.transpose(-1, -2) @ qs[qi]) * scale, kvh))
            # dK/dV move on with their block at every step; the last hop returns them to their owner
            dworks, dnext = _exchange(group, dkv, "cp.ring.dkv") if n > 1 else ([], dkv)
            for w in works + dworks:
                w.wait()
            kv, dkv = nxt, dnext
        return torch.cat(dq, dim=2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, group, balance: str = "zigzag"):
    """Causal attention of this rank's q over the whole sequence's k, v, which the ranks of
    `group` hold in slices laid out by `balance`. Shapes (batch, heads, local seq, head dim)."""
    return _RingAttention.apply(q, k, v, group, balance)


class RingAttention(nn.Module):
    """The attention core of a block under ring context parallelism."""

    def __init__(self, group, balance: str = "zigzag"):
        super().__init__()
        self.group, self.balance = group, balance

    def forward(self, q, k, v):
        device = q.device.type
        if device != "meta" and torch.is_autocast_enabled(device):
            # as attention under autocast runs (and K/V travel) in its dtype, not RoPE's float32
            dtype = torch.get_autocast_dtype(device)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        return ring_attention(q, k, v, self.group, self.balance)
