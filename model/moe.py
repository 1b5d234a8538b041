"""The mixture-of-experts layer of the reference GPT: a router and E SwiGLU experts in
place of a block's MLP (Shazeer et al. 2017; Lepikhin et al. 2020, GShard; Fedus et al.
2021, Switch Transformer; Zoph et al. 2022, ST-MoE).

Router: a linear layer to E logits, softmax in (at least) float32, the top k experts of each token,
their gates renormalised to sum to one (configurable). Experts: E SwiGLU MLPs, their
weights stacked along a leading expert dimension (`experts.w_gate` is (E, d_ff, d)), so
expert parallelism shards them by an index range.

Capacity (GShard's groups): the tokens one rank routes in one call form a token group of
T tokens; each expert takes at most C = ceil(cf · k · T / E) of the group's assignments
(capacity_factor cf; 0 means dropless, no limit). Drop policy, per expert: assignments are
ranked by the token's choice (first choices before second), then by router probability
(highest first), then by position in the group; those past C are dropped: the token gets
nothing from that expert (with every choice dropped it passes through the residual only).
The one-device reference is given the same groups (`TokenGroups`), so every layout is
exactly comparable.

Auxiliary losses, part of the training loss: Switch's load-balancing α · E · Σ_i f_i · P_i,
f_i the fraction of the (pre-drop) assignments routed to expert i, counted over every
group of the same microbatch on every rank (an all-reduce of E counts on a layout), P_i the
group's mean router probability; and ST-MoE's z-loss β · mean(logsumexp(logits)²). They
enter backward where the layer is (so a pipeline stage differentiates its own), through an
autograd function that adds their gradient at the layer's output, and are recorded for the
report. Under gradient accumulation each call's losses weigh `aux_scale` (1/microbatches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class TokenGroups:
    """How the reference's (batch, seq) tokens split into the groups the ranks of a layout
    route: `rows[g]` the batch rows of row group g (one microbatch of one dp rank), `stats[g]`
    its statistics group (the microbatch: f_i is counted over every group of it), `seqs[h]`
    the sequence positions of sequence group h (one cp rank), in that rank's order."""
    rows: list
    stats: list
    seqs: list


@dataclass
class Routing:
    """One token group's routing: its kept assignments sorted expert-major."""
    tokens: torch.Tensor  # (N,) token index in the group of each kept assignment
    gates: torch.Tensor  # (N,) its gate
    counts: torch.Tensor  # (E,) kept assignments per expert
    routed: torch.Tensor  # (E,) assignments per expert before the capacity (f_i's counts)
    dropped: int


@dataclass
class MoEStats:
    """What one layer recorded in a step, for the report (summed over its calls)."""
    aux: float = 0.0
    z: float = 0.0
    routed: list = field(default_factory=list)  # per expert, this rank's pre-drop assignments
    assignments: int = 0
    dropped: int = 0


class _AddAuxLoss(torch.autograd.Function):
    """Identity on the layer's output; in backward, also sends gradient 1 into the auxiliary
    loss, so it is trained wherever the layer sits (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out, aux):
        ctx.shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.shape, dtype=grad.dtype, device=grad.device)


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights; called on tokens sorted expert-major with the
    count of each expert's tokens."""

    def __init__(self, n: int, d: int, f: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n, f, d))
        self.w_up = nn.Parameter(torch.empty(n, f, d))
        self.w_down = nn.Parameter(torch.empty(n, d, f))

    def forward(self, x, counts):
        out, start = [], 0
        for e, n in enumerate(counts):
            xe = x[start:start + n]
            out.append(F.linear(F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e]), self.w_down[e]))
            start += n
        return torch.cat(out) if out else x[:0]


def capacity(c, tokens: int) -> int | None:
    """Expert slots per token group; None when dropless."""
    return math.ceil(c.capacity_factor * c.top_k * tokens / c.n_experts) if c.capacity_factor else None


def _balanced(probs, T: int, c) -> Routing:
    """On the meta device (planning: shapes only, no data to route) every expert gets an
    equal share of the assignments, up to its capacity."""
    E, k = c.n_experts, c.top_k
    per = T * k // E
    cap = capacity(c, T)
    kept = min(per, cap) if cap is not None else per
    counts = torch.full((E,), kept, dtype=torch.long)
    n = kept * E
    return Routing(torch.empty(n, dtype=torch.long, device="meta"), torch.empty(n, dtype=probs.dtype, device="meta"),
                   counts, torch.full((E,), per, dtype=torch.long), T * k - n)


def route(logits, c) -> tuple:
    """(probs, Routing) of one token group from its router logits (T, E)."""
    T, E, k = logits.shape[0], c.n_experts, c.top_k
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    if logits.is_meta:
        return probs, _balanced(probs, T, c)
    top, expert = probs.topk(k, dim=-1)  # (T, k)
    gates = top / top.sum(dim=-1, keepdim=True) if c.renormalize_gates else top
    e, g = expert.reshape(-1), gates.reshape(-1)  # assignment a = t·k + j
    p, choice = top.reshape(-1), torch.arange(k, device=logits.device).repeat(T)
    # priority within an expert: choice, then probability (high first), then position
    order = torch.arange(T * k, device=logits.device)
    for key in (-p, choice, e):  # stable sorts, least significant key first
        order = order[torch.sort(key[order], stable=True).indices]
    routed = torch.bincount(e, minlength=E)
    cap = capacity(c, T)
    if cap is None:
        kept = order
    else:
        starts = torch.cumsum(routed, 0) - routed
        rank = torch.arange(T * k, device=logits.device) - starts[e[order]]
        kept = order[rank < cap]
    counts = torch.bincount(e[kept], minlength=E)
    return probs, Routing(kept // k, g[kept], counts, routed, T * k - kept.numel())


def _value(x) -> float:
    """A recorded loss as a float (0 on the meta device, which has no values)."""
    if not isinstance(x, torch.Tensor):
        return float(x)
    return 0.0 if x.is_meta else float(x.detach())


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.router = nn.Linear(c.d_model, c.n_experts, bias=False)
        self.experts = Experts(c.n_experts, c.d_model, c.d_ff)
        # set by a layout (playground.parallelize) or by the equivalence check's reference:
        self.groups: TokenGroups | None = None  # reference: split the batch as the layout's ranks do
        self.stats_group = None  # layout: the ranks whose counts make f_i (an all-reduce of E counts)
        self.dispatch = None  # expert parallelism: (x sorted expert-major, counts, experts) -> outputs
        self.aux_scale = 1.0
        self.stats = MoEStats()
        self.index = None  # the block it sits in
        self.recomputing = False  # activation checkpointing runs the forward again: record nothing

    # -- one token group -------------------------------------------------------------------
    def _apply_experts(self, x, counts):
        if self.dispatch is not None:
            return self.dispatch(x, counts, self.experts)
        return self.experts(x, counts.tolist())

    def _group(self, x, routing: Routing):
        """The experts' outputs combined for the group's tokens x (T, d)."""
        y = self._apply_experts(x[routing.tokens], routing.counts)
        out = x.new_zeros(x.shape, dtype=y.dtype)  # (under autocast the experts' dtype, as a dense MLP's)
        return out.index_add(0, routing.tokens, y * routing.gates.unsqueeze(-1).to(y.dtype))

    def _losses(self, logits, probs, frac):
        """α · E · Σ f_i P_i and β · mean(logsumexp²) of one group; frac: f (E,)."""
        c = self.config
        aux = c.aux_loss_coef * c.n_experts * (frac * probs.mean(dim=0)).sum()
        z = c.z_loss_coef * torch.logsumexp(logits.to(probs.dtype), dim=-1).pow(2).mean()
        return aux, z

    def _record(self, aux, z, routed, dropped) -> None:
        if self.recomputing:
            return
        s = self.stats
        s.aux += _value(aux)
        s.z += _value(z)
        r = routed.tolist()
        s.routed = [a + b for a, b in zip(s.routed, r)] if s.routed else r
        s.assignments += int(routed.sum())
        s.dropped += dropped

    def forward(self, x):
        """x (batch, seq, d) -> (batch, seq, d)."""
        c = self.config
        if self.groups is None:  # a layout's rank: its tokens are one group
            b, s, d = x.shape
            flat = x.reshape(b * s, d)
            logits = self.router(flat)
            probs, r = route(logits, c)
            total = r.routed.clone()  # (on meta: the balanced counts, on the CPU)
            if self.stats_group is not None:
                self.stats_group.all_reduce(total, label="moe.aux_counts")
            aux, z = self._losses(logits, probs, (total.to(probs.dtype) / total.sum()).to(probs.device))
            out = self._group(flat, r).reshape(b, s, d)
            self._record(aux * self.aux_scale, z * self.aux_scale, r.routed, r.dropped)
            return _AddAuxLoss.apply(out, (aux + z) * self.aux_scale)
        return self._reference(x)

    def _reference(self, x):
        """The whole batch as the layout's ranks would route it: every (row group, sequence
        group) is a token group; f_i counted over the groups of the same microbatch; the
        auxiliary losses averaged over the groups (each group has as many tokens)."""
        c, gr = self.config, self.groups
        out = None
        cells = [(rows, seq) for rows in range(len(gr.rows)) for seq in gr.seqs]
        routed, stats = [], {}
        for g, seq in cells:
            xs = x[gr.rows[g]][:, seq]
            logits = self.router(xs.reshape(-1, xs.shape[-1]))
            probs, r = route(logits, c)
            routed.append((g, seq, xs, logits, probs, r))
            stats[gr.stats[g]] = stats.get(gr.stats[g], 0) + r.routed
        aux_total = z_total = 0
        for g, seq, xs, logits, probs, r in routed:
            total = stats[gr.stats[g]]
            aux, z = self._losses(logits, probs, total.to(probs.dtype) / total.sum())
            aux_total, z_total = aux_total + aux / len(cells), z_total + z / len(cells)
            y = self._group(xs.reshape(-1, xs.shape[-1]), r).reshape(xs.shape)
            if out is None:
                out = x.new_zeros(x.shape, dtype=y.dtype)
            rows = torch.tensor(gr.rows[g], device=x.device)
            out[rows.unsqueeze(1), torch.tensor(seq, device=x.device).unsqueeze(0)] = y
            self._record(0, 0, r.routed, r.dropped)
        if not self.recomputing:
            self.stats.aux += _value(aux_total)
            self.stats.z += _value(z_total)
        return _AddAuxLoss.apply(out, aux_total + z_total)
