"""The mixture-of-experts layer of the reference GPT: a router and E SwiGLU experts in
place of a block's MLP (Shazeer et al. 2017; Lepikhin et al. 2020, GShard; Fedus et al.
2021, Switch Transformer; Zoph et al. 2022, ST-MoE; Dai et al. 2024, DeepSeekMoE;
DeepSeek-AI 2024, DeepSeek-V3).

Router: a linear layer to E logits, scored in (at least) float32 (`router_scores`): by a
softmax (`router` "softmax" and "topk_softmax") or a sigmoid per expert ("sigmoid",
DeepSeek-V3). The top k experts of each token by score (`choose`: the discrete decision),
their gates (`routing`): "softmax" gives the chosen probabilities, with k > 1 renormalised
to sum to one (GShard), with k = 1 the raw probability (Switch Transformer: a gate
renormalised alone is exactly 1 and gives the router no gradient from the task), either
configurable (`renormalize_gates`); "topk_softmax" a softmax over the chosen logits
(Mixtral: equal to the renormalised probabilities, up to rounding); "sigmoid" the chosen
scores, normalised to sum to one like "softmax"'s (DeepSeek-V3).

Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3 §2.1.2), with
`bias_update_rate` γ > 0: a per-expert bias b (`expert_bias`, a buffer: optimizer-free
state, in checkpoints) is added to the scores for the top-k choice only, never to the
gates. After each step every b_i moves by γ·sign(mean load − load_i), the load being the
assignments routed to each expert over the whole global batch (the counts already summed
over every rank for f_i, so b is the same on every replica).

Experts: E SwiGLU MLPs of width `expert_width`, their weights stacked along a leading expert
dimension (`experts.w_gate` is (E, width, d)), so expert parallelism shards them by an index
range; and `n_shared_experts` always-on shared experts (DeepSeekMoE), one SwiGLU of their
summed width that every token passes through beside its routed experts, a dense module.

Capacity (GShard's groups): the tokens one rank routes in one call form a token group of
T tokens; each expert takes at most C = ceil(cf · k · T / E) of the group's assignments
(capacity_factor cf; 0 means dropless, no limit). Drop policy, per expert: assignments are
ranked by the token's choice (first choices before second), then by router probability
(highest first), then by position in the group; those past C are dropped: the token gets
nothing from that expert (with every choice dropped it passes through the residual only).
The one-device reference is given the same groups (`TokenGroups`), so every layout is
exactly comparable; where its decision and a layout's differ only by a near-tie (the two
sides' logits differ in their last bits), the equivalence check has it replay the
layout's decision (`Replay`) and reports it.

Auxiliary losses, part of the training loss: Switch's load-balancing α · E · Σ_i f_i · P_i,
f_i the fraction of the (pre-drop) assignments routed to expert i, counted over every
group of the same microbatch on every rank (an all-reduce of E counts on a layout), P_i the
group's mean router probability (sigmoid scores normalised over the experts first); with
`aux_loss` "sequence", DeepSeek-V3's sequence-wise form, f_i and P_i per sequence (the
counts summed over the ranks holding parts of the same sequences), averaged over the
sequences; and ST-MoE's z-loss β · mean(logsumexp(logits)²). They
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

from .compiled import region


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
    chosen: torch.Tensor | None = None  # (T, k) each token's experts (the sequence-wise counts)
    # (N,) the assignment a = t·k + j of each row (tokens = a // k); with every one of the T·k
    # routed, a permutation, which gives `local_experts` its slots without a sort
    assignments: torch.Tensor | None = None


@dataclass
class MoEStats:
    """What one layer recorded in a step, for the report (summed over its calls). While the
    step runs the calls' values stay where they are, on the layer's device (`calls`: reading
    them would stop the host until the device is idle, and summing them would launch kernels
    at every call); `resolved()` sums them and reads them once, as Python numbers."""
    aux: float = 0.0
    z: float = 0.0
    routed: list | None = None  # per expert, this rank's pre-drop assignments
    bias: list | None = None  # the balancing bias per expert after the step (a tensor until read)
    assignments: int = 0
    dropped: int = 0
    calls: list = field(default_factory=list)  # (aux, z, routed (E,) or None, dropped) of each call
    # a layout's rank with `record` set: (probs, Decision) of each call, in microbatch order
    decisions: list = field(default_factory=list)
    # the check's reference (`Replay`): groups whose own decision differed from the layout's by a
    # near-tie and took the layout's, the assignments that differed, and differences beyond a tie
    ties: int = 0
    tied: int = 0
    mismatches: list = field(default_factory=list)

    def resolved(self) -> "MoEStats":
        """The record with its calls summed and read (one copy from the device for them all;
        zeros on the meta device, which has no values)."""
        bias = self.bias.tolist() if isinstance(self.bias, torch.Tensor) and not self.bias.is_meta else \
            (None if isinstance(self.bias, torch.Tensor) else self.bias)
        if not self.calls:
            return MoEStats(self.aux, self.z, self.routed, bias, self.assignments, self.dropped, [], self.decisions,
                            self.ties, self.tied, self.mismatches)
        tensors = [x for call in self.calls for x in call[:3] if isinstance(x, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        routed = [r for _, _, r, _ in self.calls if r is not None]
        E = routed[0].numel() if routed else 0

        def column(values):
            return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
        sums = torch.cat([column([a for a, _, _, _ in self.calls]).sum().reshape(1),
                          column([z for _, z, _, _ in self.calls]).sum().reshape(1),
                          column([d for _, _, _, d in self.calls]).sum().reshape(1),
                          torch.stack(routed).to(device, torch.float64).sum(0) if routed
                          else torch.zeros(0, dtype=torch.float64, device=device)])
        values = [0.0] * sums.numel() if device.type == "meta" else sums.cpu().tolist()
        aux, z, dropped, *per_expert = values
        per_expert = [int(n) for n in per_expert] if E else []
        prior = self.routed or [0] * len(per_expert)
        return MoEStats(self.aux + aux, self.z + z, [a + b for a, b in zip(prior, per_expert)] or self.routed, bias,
                        self.assignments + sum(per_expert), self.dropped + int(dropped),
                        [], self.decisions, self.ties, self.tied, self.mismatches)

    def loss(self, device) -> torch.Tensor:
        """The step's auxiliary and z losses, summed on `device` without reading them."""
        values = [v for a, z, _, _ in self.calls for v in (a, z)]
        tensors = [v.reshape(()) for v in values if isinstance(v, torch.Tensor)]
        total = torch.stack(tensors).to(device, torch.float64).sum() if tensors \
            else torch.zeros((), dtype=torch.float64, device=device)
        return total + sum(v for v in values if not isinstance(v, torch.Tensor))

    def as_dict(self) -> dict:
        out = dict(vars(self.resolved()))
        del out["calls"]
        return out


@dataclass
class Replay:
    """The layout's routing of one step, for the check's reference (docs/architecture.md,
    "The mixture-of-experts reference"): `groups[(row group, sequence group)]` is the
    (probs, Decision) the layout's rank computed for that token group; `tolerance` the
    largest probability difference that counts as rounding. Where the reference decides
    otherwise, it takes the layout's decision when that decision is what the routing rule
    gives on the layout's probabilities and those are within `tolerance` of its own (a tie
    broken the other way by rounding); otherwise it keeps its own and records a mismatch."""
    groups: dict
    tolerance: float


class _AddAuxLoss(torch.autograd.Function):
    """Identity on the layer's output; in backward, also sends gradient `scale` into the
    auxiliary loss, so it is trained wherever the layer sits (Megatron's MoEAuxLossAutoScaler):
    1, or under fp16 the loss scale the model's loss is multiplied by (Micikevicius et al.
    2018), as Megatron's `set_loss_scale` does, so that unscaling leaves it the gradient 1."""

    @staticmethod
    def forward(ctx, out, aux, scale=1.0):
        ctx.shape, ctx.dtype, ctx.scale = aux.shape, aux.dtype, scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.shape, ctx.scale, dtype=ctx.dtype, device=grad.device), None


def _compute_dtype(x):
    """The dtype the experts' matmuls run in: autocast's where it is on (CUDA, CPU), else x's."""
    kind = x.device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def grouped_mm_applies(x, weight) -> bool:
    """Whether `torch._grouped_mm` runs the experts: bf16 on a CUDA device of compute
    capability 9.0 or more, with the model's and the experts' widths multiples of 8 (rows of
    16 bytes: its kernels' conditions), in torch versions that have it; and so on the meta
    device, where a plan prices what such a GPU runs."""
    if not (hasattr(torch, "_grouped_mm") and _compute_dtype(x) == torch.bfloat16 and weight.dim() == 3
            and weight.shape[1] % 8 == 0 and weight.shape[2] % 8 == 0):
        return False
    return x.is_meta or (x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0))


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights; called on tokens sorted expert-major with the
    count of each expert's tokens. Where the device and dtype allow, each of the three
    weights is one grouped GEMM over all experts (`torch._grouped_mm`: the experts' token
    ranges given by the counts' running sum, read on the device, so the host waits for
    nothing); elsewhere (the CPU, float32 and float64) a loop over the experts, whose
    arithmetic the one-device reference repeats exactly."""

    def __init__(self, n: int, d: int, f: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n, f, d))
        self.w_up = nn.Parameter(torch.empty(n, f, d))
        self.w_down = nn.Parameter(torch.empty(n, d, f))

    def forward(self, x, counts):
        """x (N, d) sorted expert-major; counts (E,): a tensor on x's device, or a list."""
        if grouped_mm_applies(x, self.w_gate):
            return self._grouped(x, counts)
        if isinstance(counts, torch.Tensor) and counts.is_meta:  # (a plan: no values; the rows split evenly)
            counts = even_split(x.shape[0], self.w_gate.shape[0])
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        out, start = [], 0
        for e, n in enumerate(counts):
            xe = x[start:start + n]
            out.append(F.linear(F.silu(F.linear(xe, self.w_gate[e])) * F.linear(xe, self.w_up[e]), self.w_down[e]))
            start += n
        return torch.cat(out) if out else x[:0]

    def _grouped(self, x, counts):
        return grouped_swiglu(x, torch.as_tensor(counts, device=x.device), self.w_gate, self.w_up, self.w_down)


def grouped_swiglu(x, counts, w_gate, w_up, w_down):
    """The experts' SwiGLU on rows x (N, d) sorted expert-major, `counts` (E,) rows each: three
    bf16 grouped GEMMs, each expert's rows the range its counts' running sum ends."""
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    dtype = torch.bfloat16
    x = x.to(dtype)

    def gmm(a, w):  # a (N, in) @ each expert's w (out, in)ᵀ, over its rows
        return torch._grouped_mm(a, w.to(dtype).transpose(-2, -1), offs=ends)
    return gmm(F.silu(gmm(x, w_gate)) * gmm(x, w_up), w_down)


class _Permuted(torch.autograd.Function):
    """x.index_select(0, perm) for a permutation `perm` of x's rows, whose backward is the
    gather by its inverse instead of index_select's scatter-add (atomics, in no fixed order).
    No faster on an H200, 0.38 GiB less at a 1b-moe step's peak
    (benchmarks/results/gpu/run38_moe_gather)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def token_slots(tokens, k: int, assignments=None) -> tuple:
    """(slot, at) for rows `tokens` (N,) in which each of the N/k tokens appears k times (all
    of a group's assignments, in any order): slot (N,) the rows of token 0's assignments,
    then token 1's, ..., and at (N,) its inverse, the place of each row among them (row i is
    assignment at[i] % k of token at[i] // k). Given the rows' `assignments` (a = t·k + j,
    then a permutation), at is that and slot its inverse, each token's rows in its choices'
    order; else slot is a stable sort by token, its rows in their order."""
    def inverse(perm):
        return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    if assignments is not None:
        return inverse(assignments), assignments
    slot = torch.sort(tokens, stable=True).indices
    return slot, inverse(slot)


def gather_rows(x, tokens, k: int, slots=None):
    """x.index_select(0, tokens) where each of x's T rows is in `tokens` k times: x's rows
    repeated k times, then permuted (`_Permuted`), so that no backward scatter-adds."""
    T, d = x.shape
    slot, at = slots if slots is not None else token_slots(tokens, k)
    return _Permuted.apply(x.unsqueeze(1).expand(T, k, d).reshape(T * k, d), at, slot)


def combine_rows(rows, tokens, k: int, slots=None):
    """zeros(T, d).index_add(0, tokens, rows) where each of the T tokens is in `tokens` k
    times: the rows permuted token-major (`_Permuted`) and each token's k added in the order
    its assignments come in `tokens` (deterministic, where an index_add's atomics are not)."""
    slot, at = slots if slots is not None else token_slots(tokens, k)
    n, d = rows.shape
    return _Permuted.apply(rows, slot, at).reshape(n // k, k, d).sum(dim=1)


def local_experts(x, tokens, gates, counts, w_gate, w_up, w_down, k: int, assignments=None):
    """A token group's routed output (T, d) from experts held here, by grouped GEMMs: the rows
    gathered expert-major, the experts applied, each row weighed by its gate and added to its
    token (what a GPU compiles: `MoE._group`). With all of the group's T·k assignments
    (static shapes: `static_routing`; or none dropped) the gather and the combine are
    permutations (`gather_rows`, `combine_rows`), whose backwards gather too; with the kept
    ones alone, an index_select, whose backward is a scatter-add, and an index_add. The k
    gated rows of a token are added in float32 and the sum rounded to the experts' dtype once
    (a bf16 scatter-add compiles to an accumulating index_put, which sorts the indices)."""
    T = x.shape[0]
    whole = tokens.shape[0] == T * k
    slots = token_slots(tokens, k, assignments) if whole else None
    y = grouped_swiglu(gather_rows(x, tokens, k, slots) if whole else x.index_select(0, tokens), counts,
                       w_gate, w_up, w_down)
    wide = torch.promote_types(y.dtype, torch.float32)
    weighted = y.to(wide) * gates.unsqueeze(-1)
    if whole:
        out = combine_rows(weighted, tokens, k, slots)
    else:
        out = torch.zeros(x.shape, dtype=wide, device=x.device).index_add(0, tokens, weighted)
    return out.to(y.dtype)  # (under autocast the experts' dtype, as a dense MLP's)


def to_slots(x, tokens, chosen, assignments, routed, dropped, E: int, k: int, C: int) -> tuple:
    """(x_slots (E·C, d), slot (T·k,)): a token group's rows of `static_routing` (x (T, d) its
    tokens) laid out in the experts' slots, C each (GShard): the i-th kept row of expert e
    (in the expert-major order) in slot e·C + i, zero rows in the slots left over; `slot`
    each row's slot, E·C (past the last) for a dropped one."""
    T, d = x.shape
    rows = torch.arange(T * k, device=x.device)
    expert = chosen.reshape(-1).index_select(0, assignments)  # each row's expert
    kept = routed.clamp(max=C)
    first = torch.cumsum(kept, 0) - kept  # the row each expert's kept ones start at
    slot = torch.where(rows < T * k - dropped, expert * C + rows - first.index_select(0, expert), E * C)
    source = torch.full((E * C + 1,), T, dtype=torch.long, device=x.device).scatter_(0, slot, tokens)
    return torch.cat([x, x.new_zeros(1, d)]).index_select(0, source[:E * C]), slot


def from_slots(y, slot, gates, tokens, assignments, k: int):
    """The token group's routed output (T, d) from its experts' outputs y (E·C, d) in their
    slots (`to_slots`): each row's output read from its slot (a dropped row's from a zero
    row; its gate is 0), weighed by its gate, and a token's k rows added (`combine_rows`)."""
    y = torch.cat([y, y.new_zeros(1, y.shape[1])]).index_select(0, slot)
    weighted = y.to(torch.promote_types(y.dtype, torch.float32)) * gates.unsqueeze(-1)
    return combine_rows(weighted, tokens, k, token_slots(tokens, k, assignments)).to(y.dtype)


def whole_layer(x, router, bias, w_gate, w_up, w_down, c, rows: int, scale: float, decided: bool = False) -> tuple:
    """(out, aux, z, loss, routed, dropped): a token group's router logits (x @ routerᵀ),
    routing (`static_route`), balancing losses (`balance_losses`, f_i from this group's counts
    alone; aux and z weighed by `scale`, loss their sum) and experts (`local_experts`), one
    after another: what a GPU compiles as one region when the layer has nothing to exchange
    with other ranks (`MoE._whole_on_gpu`), the compiled regions' host cost paid once a layer
    instead of three times, and the router's and the losses' eager ops none. With `decided`
    (a layout's rank under the check), also the routing's scores, chosen experts and
    assignments: the decision it made (`MoE._keep_decision`)."""
    logits = F.linear(x, router)
    scores, tokens, gates, counts, routed, dropped, chosen, assignments = static_route(logits, bias, c)
    f = sequence_counts(chosen, rows, c.n_experts) if c.aux_loss == "sequence" else routed
    aux, z = balance_losses(logits, scores, f, c)
    aux, z = aux * scale, z * scale
    out = local_experts(x, tokens, gates, counts, w_gate, w_up, w_down, c.top_k, assignments)
    if decided:
        return out, aux, z, aux + z, routed, dropped, scores.detach(), chosen, assignments
    return out, aux, z, aux + z, routed, dropped


def capacity(c, tokens: int) -> int | None:
    """Expert slots per token group; None when dropless."""
    return math.ceil(c.capacity_factor * c.top_k * tokens / c.n_experts) if c.capacity_factor else None


def even_split(n: int, parts: int) -> list:
    """n split into `parts` as evenly as can be, the left-over ones one each to the first."""
    per, extra = divmod(n, parts)
    return [per + (i < extra) for i in range(parts)]


def _balanced(probs, T: int, c) -> Routing:
    """On the meta device (planning: shapes only, no data to route) every expert gets an
    equal share of the assignments, up to its capacity (the T·k mod E left over dropped, as
    `choose` keeps on meta); dropless, every assignment, the left-over ones one each to the
    first experts."""
    E, k = c.n_experts, c.top_k
    per = T * k // E
    cap = capacity(c, T)
    if cap is None:
        counts = torch.tensor(even_split(T * k, E), dtype=torch.long)
        routed = counts.clone()
    else:
        counts, routed = torch.full((E,), min(per, cap), dtype=torch.long), torch.full((E,), per, dtype=torch.long)
    n = int(counts.sum())
    return Routing(torch.empty(n, dtype=torch.long, device="meta"), torch.empty(n, dtype=probs.dtype, device="meta"),
                   counts, routed, T * k - n)


@dataclass
class Decision:
    """One token group's discrete routing: what the probabilities decide, apart from the
    gates they give (`routing`)."""
    experts: torch.Tensor  # (T, k) each token's experts, in choice order
    kept: torch.Tensor  # (N,) the assignments a = t·k + j within the capacity, expert-major in priority order

    def same(self, other: "Decision") -> bool:
        return torch.equal(self.experts, other.experts) and torch.equal(self.kept, other.kept)

    def differing(self, other: "Decision") -> int:
        """Kept assignments (token, expert, choice) that one decision has and the other has
        not, counted once per change (0: the same assignments in another order)."""
        def kept(d):
            k = d.experts.shape[1]
            return set(zip((d.kept // k).tolist(), d.experts.reshape(-1)[d.kept].tolist(), (d.kept % k).tolist()))
        if self.experts.shape != other.experts.shape:
            return max(self.kept.numel(), other.kept.numel())
        return (len(kept(self) ^ kept(other)) + 1) // 2


def _ranked(probs, c) -> tuple:
    """(top, expert, order, routed, within): each token's top-k selection scores and experts
    (T, k); the assignments a = t·k + j expert-major, ranked by choice, then score (high
    first), then position; and, with a capacity (None without one), the assignments per expert
    (E,) and whether each ranked assignment is within its expert's capacity. `probs`: the
    selection scores (T, E), the router's scores plus the balancing bias where there is one."""
    T, E, k = probs.shape[0], c.n_experts, c.top_k
    top, expert = top_k(probs, k)  # (T, k)
    e, p = expert.reshape(-1), top.reshape(-1)
    key = e * k + torch.arange(k, device=probs.device).repeat(T)  # expert and choice: one integer
    if p.dtype == torch.float32:  # one stable sort of (key, -p) packed in 64 bits: ties keep the position
        order = torch.sort(key * 2 ** 32 + _ascending_bits(-p), stable=True).indices
    else:  # stable sorts, least significant key first: probability (high first), then the key
        order = torch.sort(-p, stable=True).indices
        order = order[torch.sort(key[order], stable=True).indices]
    cap = capacity(c, T)
    if cap is None:
        return top, expert, order, None, None
    routed = _count(e, E)
    within = torch.arange(T * k, device=probs.device) - (torch.cumsum(routed, 0) - routed)[e[order]] < cap
    return top, expert, order, routed, within


def top_k(probs, k: int) -> tuple:
    """(values, indices) of each row's k largest entries, highest first, exact ties to the
    lower index: a stable sort of the row, so that every device decides alike. torch.topk
    breaks exact ties as its kernel happens to (CUDA's otherwise than the CPU's), and bf16
    logits tie often (8 bits of mantissa): the check replays a GPU layout's decisions on the
    CPU and must get the same experts from the same scores. (+0.0 makes -0 +0, which sort
    equal.)"""
    expert = torch.sort(-probs + 0.0, dim=-1, stable=True).indices[..., :k]
    return probs.gather(-1, expert), expert


def _ascending_bits(x):
    """float32 x as int64 keys in [0, 2³²) that sort as x does (IEEE 754's sign-magnitude bits,
    the negatives' magnitudes reversed; -0 taken as +0, which compares equal to it)."""
    bits = (x + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) + 2 ** 31


def _gates(scores, experts, c):
    """The chosen experts' gates (T, k) from the router's scores (T, E; differentiable):
    their scores, renormalised over the token's k choices when the config says so
    (`GPTConfig.renormalizes`); with router "topk_softmax" a softmax over the chosen logits
    (Mixtral), computed from the log-probabilities, which differ from the logits by one
    constant per token."""
    top = scores.gather(1, experts)
    if c.router == "topk_softmax":
        return torch.softmax(top.log(), dim=-1)
    return top / top.sum(dim=-1, keepdim=True) if c.renormalizes else top


def choose(probs, c) -> Decision:
    """The top-k experts of each token (T, E selection scores) and, per expert, the
    assignments within its capacity: ranked by the token's choice, then score (high first),
    then position in the group."""
    _, expert, order, _, within = _ranked(probs, c)
    if within is None:
        return Decision(expert, order)
    if probs.is_meta:  # shapes only (a plan): the kept assignments of balanced routing (_balanced)
        T, E, k = probs.shape[0], c.n_experts, c.top_k
        return Decision(expert, order[:E * min(T * k // E, capacity(c, T))])
    return Decision(expert, order[within])


def static_routing(scores, selection, c) -> Routing:
    """The group's Routing under `choose`'s decision on `selection` (the router's `scores`
    plus any balancing bias), with a capacity, in shapes that do not
    depend on the values: all T·k assignments, the kept ones first (expert-major, as `choose`
    orders them), then the dropped ones, given to the last expert's range with gate 0. Each
    expert keeps min(its assignments, C), so the counts are known on the device and nothing
    waits for the host (a GPU then runs the layer without a sync, and torch.compile without a
    graph break). The outputs are those of `routing(scores, choose(selection, c), c)`: a
    dropped row adds 0 to its token, and its gate gets no gradient; the experts do the dropped
    rows' arithmetic for nothing (few, at a capacity factor of 1 or more)."""
    T, k = scores.shape[0], c.top_k
    _, expert, order, routed, within = _ranked(selection, c)
    kept = within.sum()
    # the kept ones first, then the dropped ones, each in their order (a stable partition)
    place = torch.where(within, torch.cumsum(within, 0) - 1, kept + torch.cumsum(~within, 0) - 1)
    order = torch.empty_like(order).scatter_(0, place, order)
    counts = routed.clamp(max=capacity(c, T))
    counts[-1] += T * k - kept  # the dropped rows, weighted 0, at the end of the last expert's range
    mask = torch.arange(T * k, device=scores.device) < kept
    gates = _gates(scores, expert, c).reshape(-1).index_select(0, order)  # (see `routing`)
    return Routing(order // k, gates * mask, counts, routed, T * k - kept, expert, order)


def routing(scores, decision: Decision, c) -> Routing:
    """The group's Routing under `decision`, its gates taken from the router's `scores`
    (differentiable; `_gates`)."""
    T, E, k = scores.shape[0], c.n_experts, c.top_k
    gates = _gates(scores, decision.experts, c)
    e, kept = decision.experts.reshape(-1), decision.kept
    # an index_select, whose backward is a scatter-add (gates[kept]'s is an accumulating index_put,
    # which sorts the indices: 0.43 ms a layer of a 1b-moe step on an H200)
    return Routing(kept // k, gates.reshape(-1).index_select(0, kept), _count(e[kept], E), _count(e, E),
                   T * k - kept.numel(), decision.experts, kept)


def _count(experts, E: int) -> torch.Tensor:
    """How many of `experts` (expert ids) are each of the E experts: bincount's result, as a
    comparison with each id and a sum (a reduction), since torch.bincount on a GPU reads its
    input's largest value on the host, and a scatter-add of ones compiles to an accumulating
    index_put that sorts its indices (0.43 ms a layer of a 1b-moe step on an H200:
    benchmarks/results/gpu/run38_moe_gather)."""
    return (experts.reshape(-1, 1) == torch.arange(E, device=experts.device)).sum(dim=0)


def router_scores(logits, c):
    """The router's scores (T, E) of its logits, in at least float32: softmax probabilities,
    or with router "sigmoid" an independent sigmoid per expert (DeepSeek-V3)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.sigmoid(x) if c.router == "sigmoid" else torch.softmax(x, dim=-1)


def balance_probs(scores, c):
    """The per-token terms of the balancing loss's P_i (T, E): the softmax probabilities, or
    sigmoid scores normalised over the experts (DeepSeek-V3, eq. 19)."""
    return scores / scores.sum(dim=-1, keepdim=True) if c.router == "sigmoid" else scores


def selection_scores(scores, bias):
    """What the top-k choice ranks: the scores plus the balancing bias (not differentiated;
    None: no bias)."""
    return scores.detach() if bias is None else scores.detach() + bias.to(scores.dtype)


def static_route(logits, bias, c) -> tuple:
    """(scores, *Routing's fields) of one token group, in shapes that do not depend on the
    values: dropless, every assignment in `choose`'s order; with a capacity, `static_routing`.
    What a GPU compiles (`MoE.forward`)."""
    scores = router_scores(logits, c)
    selection = selection_scores(scores, bias)
    r = static_routing(scores, selection, c) if c.capacity_factor else routing(scores, choose(selection, c), c)
    return scores, r.tokens, r.gates, r.counts, r.routed, r.dropped, r.chosen, r.assignments


def balance_losses(logits, scores, counts, c) -> tuple:
    """α · E · Σ f_i P_i and β · mean(logsumexp²) of one token group. counts: the assignments
    per expert (E,) that make f_i (aux_loss "batch"), or per sequence and expert (rows, E),
    each sequence's f_i and P_i then taken alone and the products averaged over them."""
    frac = counts.to(scores.dtype).to(scores.device)
    frac = frac / frac.sum(dim=-1, keepdim=True)
    p = balance_probs(scores, c)
    if counts.dim() == 1:
        aux = c.aux_loss_coef * c.n_experts * (frac * p.mean(dim=0)).sum()
    else:  # DeepSeek-V3's sequence-wise balance loss (eqs. 17-20)
        per_seq = p.reshape(counts.shape[0], -1, c.n_experts).mean(dim=1)
        aux = c.aux_loss_coef * c.n_experts * (frac * per_seq).sum(dim=-1).mean()
    z = c.z_loss_coef * torch.logsumexp(logits.to(scores.dtype), dim=-1).pow(2).mean()
    return aux, z


def route(logits, c, bias=None) -> tuple:
    """(scores, Routing) of one token group from its router logits (T, E) and the balancing
    bias (E,) or None."""
    scores = router_scores(logits, c)
    decision = choose(selection_scores(scores, bias), c)
    if logits.is_meta:  # a plan: the ops a GPU runs to route (shapes only), with balanced counts
        r, balanced = routing(scores, decision, c), _balanced(scores, logits.shape[0], c)
        return scores, Routing(r.tokens, r.gates, balanced.counts, balanced.routed, balanced.dropped, r.chosen,
                               r.assignments)
    return scores, routing(scores, decision, c)


def _detached(x):
    """A recorded loss: a float, or a detached 0-d tensor kept on its device."""
    return x.detach() if isinstance(x, torch.Tensor) else float(x)


def sequence_counts(chosen, rows: int, E: int) -> torch.Tensor:
    """(rows, E): each sequence's assignments per expert, from each token's experts (T, k),
    the T tokens being `rows` sequences of T/rows tokens in order."""
    T, k = chosen.shape
    row = torch.arange(T, device=chosen.device).div(T // rows, rounding_mode="floor").repeat_interleave(k)
    return _count(row * E + chosen.reshape(-1), rows * E).reshape(rows, E)


class MoE(nn.Module):
    # kept in float32 beside 16-bit compute copies: steps of γ = 1e-3 vanish in bf16 once the
    # bias reaches 0.5 (its spacing there is 2^-8), and are doubled from 0.25 (Megatron-Core's
    # router keeps its expert bias in float32 "to avoid routing errors when updating" it)
    float32_buffers = ("expert_bias",)

    def __init__(self, c, shared: nn.Module | None = None):
        """shared: the shared experts' SwiGLU (n_shared_experts · expert_width wide), or None."""
        super().__init__()
        self.config = c
        self.router = nn.Linear(c.d_model, c.n_experts, bias=False)
        self.experts = Experts(c.n_experts, c.d_model, c.expert_width)
        self.shared = shared
        # the auxiliary-loss-free balancing bias (optimizer-free state: zero at the start, moved
        # by `update_bias`; the model's materialize gives it storage); None without one
        self.register_buffer("expert_bias", torch.zeros(c.n_experts) if c.bias_update_rate else None,
                             persistent=False)
        self.load = None  # the step's assignments per expert over every rank, for `update_bias`
        # set by a layout (playground.parallelize) or by the equivalence check's reference:
        self.groups: TokenGroups | None = None  # reference: split the batch as the layout's ranks do
        self.stats_group = None  # layout: the ranks whose counts make f_i (an all-reduce of E counts)
        self.sequence_group = None  # layout: the ranks holding other parts of the same sequences
        self.dispatch = None  # expert parallelism: (x sorted expert-major, counts, experts) -> outputs
        self.aux_scale = 1.0
        self.loss_scale = 1.0  # the gradient the auxiliary losses' backward starts from (fp16's loss scale)
        self.stats = MoEStats()
        self.index = None  # the block it sits in
        self.recomputing = False  # activation checkpointing runs the forward again: record nothing
        self.checkpointed = False  # its block is activation-checkpointed (set by activation_checkpointing)
        self.record = False  # a layout's rank under the check: keep each call's (scores, Decision)
        self.replay: Replay | None = None  # the check's reference: the layout's decisions this step
        self.graph = None  # the layer's region as CUDA graphs (`use_cuda_graphs`), or None

    def use_cuda_graphs(self, graphs) -> None:
        """Replay the layer's one compiled region (`whole_layer`) as CUDA graphs of `graphs`
        (model/cuda_graphs.py): its aux and z losses and its counts are kept past the call
        (the step's record and load), so they are copied out of the graph's buffers."""
        self.graph = graphs.site(keep=(1, 2, 4, 5))

    # -- the balancing bias ------------------------------------------------------------------
    def _add_load(self, routed) -> None:
        """Count a call's assignments per expert (summed over every rank) into the step's load."""
        if self.expert_bias is not None and not self.recomputing:
            self.load = routed if self.load is None else self.load + routed

    def update_bias(self, found_inf=None) -> None:
        """After the step: b_i += γ · sign(mean load − load_i) (Wang et al. 2024, eq. 5;
        DeepSeek-V3 §2.1.2), compared in whole numbers (E · load_i against the total load);
        not where `found_inf` (0-d, 1.0: the step skipped on the device) says so."""
        if self.expert_bias is None:
            return
        if self.load is not None:
            load = self.load.to(self.expert_bias.device)
            sign = torch.sign(load.sum() - self.config.n_experts * load).to(self.expert_bias.dtype)
            if found_inf is not None:
                sign = sign * (1 - found_inf.to(sign.device, sign.dtype))
            self.expert_bias.add_(sign, alpha=self.config.bias_update_rate)
            self.load = None
        self.stats.bias = self.expert_bias.detach().clone()

    # -- one token group -------------------------------------------------------------------
    def _apply_experts(self, x, counts, during=None):
        """(the experts' outputs for the rows x, what `during` returned: under expert
        parallelism computed while the combine is in flight (moe/dispatch.py), else after)."""
        if self.dispatch is not None:
            return self.dispatch(x, counts, self.experts, during)
        return self.experts(x, counts), during() if during is not None else None

    def _shared_of(self, x):
        """The shared experts' output for the group's tokens x as a deferred call, or None."""
        return None if self.shared is None else (lambda: self.shared(x))

    def _pads(self) -> bool:
        """Whether its tokens go to other ranks' experts through the padded dispatch (expert
        parallelism at a capacity)."""
        return self.dispatch is not None and bool(self.config.capacity_factor)

    def _padded(self, x, r: Routing):
        """The routed output (T, d) of the group's tokens x through expert parallelism at a
        capacity C, in static shapes (`static_routing`'s rows; the dispatch's `padded`): each
        kept row placed in its expert's next slot of E·C (row i of expert e's kept ones, in
        the expert-major order, in slot e·C + i), the slots gathered from the tokens (a zero
        row where an expert has fewer than C), sent and brought back, and each row's output
        read from its slot (a dropped row from a zero row, its gate 0) and added to its token.
        Returns (the shared experts' output, run while the combine is in flight, or None; the
        routed output)."""
        c = self.config
        T, d = x.shape
        E, k, C = c.n_experts, c.top_k, capacity(c, T)
        size, rows = x.element_size(), T * k
        # (each a compiled region on a GPU: tokens in, slots out, the rows' indices; and back)
        x_slots, slot = region("moe_pad", size * (T * d + E * C * d) + 8 * 5 * rows, to_slots, x, r.tokens,
                               r.chosen, r.assignments, r.routed, r.dropped, E, k, C, checkpointed=self.checkpointed)
        y, shared = self.dispatch.padded(x_slots, C, self.experts, self._shared_of(x))
        return shared, region("moe_unpad", size * (E * C * d + 2 * 2 * rows * d + T * d) + 8 * 3 * rows, from_slots,
                              y, slot, r.gates, r.tokens, r.assignments, k, checkpointed=self.checkpointed)

    def _group(self, x, routing: Routing):
        """The experts' outputs combined for the group's tokens x (T, d), the shared experts' added."""
        e, shared = self.experts, None
        if self._pads():
            shared, out = self._padded(x, routing)
        elif self.dispatch is None and grouped_mm_applies(x, e.w_gate):  # (one compiled region on a GPU)
            io = self._experts_io(x.shape[0], routing.tokens.shape[0])
            out = region("moe_local_experts", io, local_experts, x, routing.tokens, routing.gates, routing.counts,
                         e.w_gate, e.w_up, e.w_down, self.config.top_k, routing.assignments,
                         checkpointed=self.checkpointed)
        else:
            y, shared = self._apply_experts(x.index_select(0, routing.tokens), routing.counts, self._shared_of(x))
            out = x.new_zeros(x.shape, dtype=y.dtype)  # (under autocast the experts' dtype, as a dense MLP's)
            out = out.index_add(0, routing.tokens, y * routing.gates.unsqueeze(-1).to(y.dtype))
        if self.shared is None:
            return out
        return out + (shared if shared is not None else self.shared(x))

    def _experts_io(self, T: int, rows: int) -> int:
        """What the local experts' region reads and writes in HBM for T tokens routed to `rows`
        rows: the tokens and the output; the gathered rows, the three GEMMs' outputs and the
        gated product, each written and read (bf16); the weights read once where they are in
        16 bits (compute copies: `--bf16-copies`), else read in their dtype with their bf16
        casts written and read (autocast's fp32 weights)."""
        d, f, n = self.config.d_model, self.experts.w_gate.shape[1], self.experts.w_gate.numel()
        w = self.experts.w_gate.element_size()
        return 2 * (T * d + 2 * rows * d + 2 * 3 * rows * f + 2 * rows * d) + 3 * n * (w if w == 2 else w + 4)

    def _whole_on_gpu(self, flat) -> bool:
        """Whether the layer runs as one compiled region (`whole_layer`): on a GPU where the
        grouped GEMMs apply, with its experts here (no dispatch), its f_i from its own tokens
        (no statistics or sequence group) and its router a plain linear layer (not sequence
        parallel), under the check too (the region then also gives the decision it made); and
        so in a plan of such a layer (the meta device), which prices the region as one kernel.
        Elsewhere the same functions run in three regions, each priced as one kernel by the
        simulator."""
        return ((flat.is_cuda or flat.is_meta) and self.dispatch is None and self.stats_group is None
                and self.sequence_group is None and type(self.router) is nn.Linear
                and grouped_mm_applies(flat, self.experts.w_gate))

    def _keep_decision(self, scores, r: Routing) -> None:
        """Keep the decision the group's routing `r` made (its experts, and the assignments
        within the capacity: the kept ones come first in static shapes) with the selection
        scores it was made on, for the check (`record`: a layout's rank under the check).
        Read from the routing the layer computes with, so the check judges the arithmetic
        training runs."""
        if self.recomputing:
            return
        kept = r.assignments[:r.assignments.numel() - int(r.dropped)]
        self.stats.decisions.append((selection_scores(scores, self.expert_bias).to("cpu", copy=True),
                                     Decision(r.chosen.cpu(), kept.cpu())))

    def _replayed(self, logits, cell):
        """The reference's routing of one token group under `self.replay` (see `Replay`)."""
        c = self.config
        if logits.is_meta:
            return route(logits, c, self.expert_bias)
        scores = router_scores(logits, c)
        chosen_by = selection_scores(scores, self.expert_bias)
        own = choose(chosen_by, c)
        theirs = self.replay.groups.get(cell) if self.replay is not None else None
        if theirs is None or own.same(theirs[1]):
            return scores, routing(scores, own, c)
        their_scores, decision = theirs
        gap = (their_scores.double() - chosen_by.cpu().double()).abs().max().item() \
            if their_scores.shape == chosen_by.shape else float("inf")
        if gap <= self.replay.tolerance and choose(their_scores, c).same(decision):
            if not self.recomputing:  # (counted once, replayed every time)
                self.stats.ties += 1
                self.stats.tied += own.differing(decision)
            return scores, routing(scores, Decision(decision.experts.to(scores.device), decision.kept.to(scores.device)),
                                   c)
        if not self.recomputing:
            why = f"scores {gap:.1e} apart" if gap > self.replay.tolerance else \
                "the layout's decision is not what its own scores give"
            self.stats.mismatches.append(f"block {self.index}, token group {cell}: {own.differing(decision)} "
                                         f"assignments routed otherwise ({why})")
        return scores, routing(scores, own, c)

    def _record(self, aux, z, routed, dropped) -> None:
        """Keep a call's losses and counts for the step's record (MoEStats: summed when read,
        so a call launches no kernel for it)."""
        if not self.recomputing:
            self.stats.calls.append((_detached(aux), _detached(z), routed, dropped))

    def forward(self, x):
        """x (batch, seq, d) -> (batch, seq, d)."""
        c = self.config
        if self.groups is None:  # a layout's rank: its tokens are one group
            b, s, d = x.shape
            flat = x.reshape(b * s, d)
            if self._whole_on_gpu(flat):
                e, T = self.experts, flat.shape[0]
                # what it reads and writes in HBM: the router's weight and its bf16 copy, each
                # token's k rows of routing (token, gate, order), and the local experts' (above)
                io = 6 * c.n_experts * c.d_model + 20 * T * c.top_k + self._experts_io(T, T * c.top_k)
                # (under the check, with the decision it made; not as CUDA graphs, which hold the
                # outputs a replay rewrites)
                out, aux, z, loss, routed, dropped, *decided = region(
                    "moe_layer", io, whole_layer, flat, self.router.weight, self.expert_bias, e.w_gate, e.w_up, e.w_down,
                    c, b, self.aux_scale, self.record, checkpointed=self.checkpointed,
                    graph=None if self.record else self.graph)
                if decided and not flat.is_meta:
                    scores, chosen, assignments = decided
                    self._keep_decision(scores, Routing(None, None, None, routed, dropped, chosen, assignments))
                self._add_load(routed)
                if self.shared is not None:
                    out = out + self.shared(flat)
                self._record(aux, z, routed, dropped)
                return _AddAuxLoss.apply(out.reshape(b, s, d), loss, self.loss_scale)
            logits = self.router(flat)
            # in static shapes (compiled on a GPU; at a capacity the dispatch is the padded one,
            # `_padded`), except in a plan sending tokens dropless to other ranks (the uneven
            # dispatch's sizes: balanced counts on the host); under the check too, its decision
            # kept from the same routing
            if self.dispatch is None or not logits.is_meta or self._pads():
                T, E, k = logits.shape[0], c.n_experts, c.top_k
                io = T * E * (logits.element_size() + 4) + T * k * 20 + 4 * E * 8  # logits in; scores, rows out
                scores, *fields = region("moe_routing", io, static_route, logits, self.expert_bias, c,
                                         checkpointed=self.checkpointed)
                r = Routing(*fields)
                if self.record and not logits.is_meta:
                    self._keep_decision(scores, r)
            else:
                scores, r = route(logits, c, self.expert_bias)
            total = r.routed.clone()  # (on meta: the balanced counts, on the CPU)
            if self.stats_group is not None:
                self.stats_group.all_reduce(total, label="moe.aux_counts")
            self._add_load(total)
            counts = total
            if c.aux_loss == "sequence":
                counts = sequence_counts(r.chosen, b, c.n_experts)
                if self.sequence_group is not None:
                    self.sequence_group.all_reduce(counts, label="moe.aux_counts_seq")
            aux, z = region("moe_balance_losses", logits.nbytes + scores.nbytes + counts.nbytes, balance_losses,
                            logits, scores, counts, c, checkpointed=self.checkpointed)
            out = self._group(flat, r).reshape(b, s, d)
            self._record(aux * self.aux_scale, z * self.aux_scale, r.routed, r.dropped)
            return _AddAuxLoss.apply(out, (aux + z) * self.aux_scale, self.loss_scale)
        return self._reference(x)

    def _reference(self, x):
        """The whole batch as the layout's ranks would route it: every (row group, sequence
        group) is a token group; f_i counted over the groups of the same microbatch (or, per
        sequence, over the sequence groups of the same rows); the auxiliary losses averaged
        over the groups (each group has as many tokens)."""
        gr, c = self.groups, self.config
        out = None
        cells = [(rows, h, seq) for rows in range(len(gr.rows)) for h, seq in enumerate(gr.seqs)]
        routed, stats, per_row = [], {}, {}
        for g, h, seq in cells:
            xs = x[gr.rows[g]][:, seq]
            logits = self.router(xs.reshape(-1, xs.shape[-1]))
            scores, r = self._replayed(logits, (g, h))
            routed.append((g, seq, xs, logits, scores, r))
            stats[gr.stats[g]] = stats.get(gr.stats[g], 0) + r.routed
            if c.aux_loss == "sequence" and not logits.is_meta:
                per_row[g] = per_row.get(g, 0) + sequence_counts(r.chosen, len(gr.rows[g]), c.n_experts)
            self._add_load(r.routed)
        aux_total = z_total = 0
        for g, seq, xs, logits, scores, r in routed:
            counts = per_row[g] if c.aux_loss == "sequence" and not logits.is_meta else stats[gr.stats[g]]
            aux, z = balance_losses(logits, scores, counts, c)
            aux_total, z_total = aux_total + aux / len(cells), z_total + z / len(cells)
            y = self._group(xs.reshape(-1, xs.shape[-1]), r).reshape(xs.shape)
            if out is None:
                out = x.new_zeros(x.shape, dtype=y.dtype)
            rows = torch.tensor(gr.rows[g], device=x.device)
            out[rows.unsqueeze(1), torch.tensor(seq, device=x.device).unsqueeze(0)] = y
            self._record(0, 0, r.routed, r.dropped)
        if not self.recomputing:
            self.stats.calls.append((_detached(aux_total), _detached(z_total), None, 0))
        return _AddAuxLoss.apply(out, aux_total + z_total, self.loss_scale)
