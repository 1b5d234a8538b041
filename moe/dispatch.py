"""Token dispatch for expert parallelism (Lepikhin et al. 2020, GShard; the all-to-all
token dispatcher of Megatron-Core and torchtitan).

The E experts are split over the ep ranks of the group, E/ep each, rank j holding experts
[j·E/ep, (j+1)·E/ep). A rank's kept assignments arrive sorted expert-major with the count
of each expert's tokens. Then:

1. the counts are exchanged first (`moe.counts`: an all-to-all of E integers), so each
   rank knows how many tokens every source sends each of its experts;
2. the tokens go to the ranks of their experts in one uneven all-to-all (`moe.dispatch`),
   arriving source-major (from rank 0: its tokens for my expert 0, for my expert 1, ...;
   from rank 1: ...), and are regrouped expert-major for the local experts;
3. the outputs are put back source-major and return by the reverse all-to-all
   (`moe.combine`); the layer then weighs them by their gates and adds them up.

With a capacity C (GShard's own formulation) the sizes need not be exchanged at all
(`ExpertParallelDispatch.padded`): each rank lays its kept assignments out in E·C slots,
expert e's in slots [e·C, e·C + kept_e), the rest zero rows, and both all-to-alls are even,
E/ep·C rows to every rank; the receiver regroups them expert-major (each local expert gets
ep·C rows, from every source in turn). Nothing is read on the host (no counts exchange, no
host sync: Megatron-Core's `moe_pad_expert_input_to_capacity`); a zero row's SwiGLU output is
exactly zero and gives its expert no gradient, so the results are those of the uneven
dispatch; each all-to-all moves (ep − 1)·E/ep·C rows × d × element size a rank, padding
included.

Both all-to-alls are autograd functions whose backward is the all-to-all with the splits
swapped, so the experts' gradients sum the contributions of every source rank's tokens.
The combine is issued asynchronously and the layer's shared experts (DeepSeekMoE) run while
it is in flight (`during`), as Megatron-Core overlaps the shared experts with the token
exchange: in the forward they hide the combine; in the backward, since their autograd nodes
were made after the combine started and before it was waited, the engine (latest made first)
runs their backward while the combine's reverse all-to-all is in flight.
Dropless routing uses the same exchanged counts for its uneven splits. Each all-to-all
moves, per rank, exactly the tokens routed to experts on other ranks × d × element size.
"""
from __future__ import annotations

import torch


def _all_to_all(x, group, out_splits, in_splits, label, async_op: bool = False):
    """The all-to-all's output; with `async_op`, (the output, filled once the Work is waited, the Work)."""
    out = torch.empty((sum(out_splits), *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = group.all_to_all(out, x.contiguous(), out_splits=out_splits, in_splits=in_splits, async_op=async_op,
                            label=label)
    return (out, work) if async_op else out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, label):
        ctx.group, ctx.splits, ctx.label = group, (out_splits, in_splits), label
        return _all_to_all(x, group, out_splits, in_splits, label)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, ctx.group, in_splits, out_splits, ctx.label), None, None, None, None


def all_to_all(x, group, out_splits, in_splits, label: str):
    """Differentiable uneven all-to-all along dim 0."""
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits), label)


class _InFlight:
    """One all-to-all between its start and its wait: the call's Work, and in the backward
    the buffer the reverse all-to-all's result lands in."""
    work = None
    grad = None


class _Start(torch.autograd.Function):
    """The all-to-all issued without waiting (its output is filled when `_Wait` has run).
    Backward: the reverse all-to-all `_Wait`'s backward issued, waited for; its result is
    this input's gradient."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, label, flight):
        ctx.flight = flight
        out, flight.work = _all_to_all(x, group, out_splits, in_splits, label, async_op=True)
        return out

    @staticmethod
    def backward(ctx, _):
        flight = ctx.flight
        flight.work.wait()
        grad, flight.grad, flight.work = flight.grad, None, None
        return grad, None, None, None, None, None


class _Wait(torch.autograd.Function):
    """The wait of `_Start`'s call: its output, filled. Backward: the reverse all-to-all
    issued without waiting (`_Start`'s backward waits for it)."""

    @staticmethod
    def forward(ctx, out, group, out_splits, in_splits, label, flight):
        flight.work.wait()
        flight.work = None  # (the call's Work holds its buffers: let go of them, as of the call)
        ctx.group, ctx.splits, ctx.label, ctx.flight = group, (out_splits, in_splits), label, flight
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (out_splits, in_splits), flight = ctx.splits, ctx.flight
        flight.grad, flight.work = _all_to_all(grad, ctx.group, in_splits, out_splits, ctx.label, async_op=True)
        return grad, None, None, None, None, None


def all_to_all_during(x, group, out_splits, in_splits, label: str, during):
    """`all_to_all`, with `during()` (autograd on) run while the call is in flight, forward
    and backward: (the all-to-all's output, what `during` returned)."""
    flight = _InFlight()
    out = _Start.apply(x, group, list(out_splits), list(in_splits), label, flight)
    extra = during()
    return _Wait.apply(out, group, list(out_splits), list(in_splits), label, flight), extra


class ExpertParallelDispatch:
    """The layer's `dispatch`: (tokens sorted expert-major, counts of all E experts, the
    local experts) -> their outputs, in the same order."""

    def __init__(self, group, n_experts: int):
        self.group, self.n_experts = group, n_experts
        self.local = n_experts // group.size

    def __call__(self, x, counts, experts, during=None):
        """`during` (or None): computed while the combine is in flight (the shared experts);
        then (the outputs, what `during` returned)."""
        ep, local = self.group.size, self.local
        send = counts.reshape(ep, local)  # per destination rank, per its expert
        recv = torch.empty_like(send)
        self.group.all_to_all(recv, send.contiguous(), label="moe.counts")
        # the host needs the sizes, as every dispatcher does: one copy of both, the layer's one wait
        send_c, recv_c = torch.stack([send, recv]).tolist()
        in_splits, out_splits = [sum(r) for r in send_c], [sum(r) for r in recv_c]
        got = all_to_all(x, self.group, out_splits, in_splits, "moe.dispatch")
        # source-major -> expert-major for the local experts
        pieces, start = [], 0
        for src in range(ep):
            for e in range(local):
                pieces.append((e, src, start, recv_c[src][e]))
                start += recv_c[src][e]
        order = sorted(pieces)
        index = torch.cat([torch.arange(a, a + n, device=x.device) for _, _, a, n in order]) if start else \
            torch.zeros(0, dtype=torch.long, device=x.device)
        per_expert = [sum(recv_c[src][e] for src in range(ep)) for e in range(local)]
        y = experts(got[index], per_expert)
        inverse = torch.empty_like(index)
        inverse[index] = torch.arange(index.numel(), device=index.device)
        return self._combine(y[inverse], in_splits, out_splits, during)  # source-major again

    def _combine(self, y, out_splits, in_splits, during):
        if during is None:
            return all_to_all(y, self.group, out_splits, in_splits, "moe.combine"), None
        return all_to_all_during(y, self.group, out_splits, in_splits, "moe.combine", during)

    def padded(self, x, capacity: int, experts, during=None):
        """x (E·C, d): the rank's rows in its experts' slots (`capacity` C each, zero rows where
        an expert has fewer) -> (the experts' outputs in the same slots, what `during`
        returned: computed while the combine is in flight); even all-to-alls only."""
        ep, local, C = self.group.size, self.local, capacity
        d, n = x.shape[1], local * C  # rows for each destination
        got = all_to_all(x, self.group, [n] * ep, [n] * ep, "moe.dispatch")  # source-major
        got = got.reshape(ep, local, C, d).transpose(0, 1).reshape(local * ep * C, d)
        # on a GPU a device tensor (a list would be copied to it from the host)
        per_expert = torch.full((local,), ep * C, dtype=torch.long, device=x.device) if x.is_cuda else [ep * C] * local
        y = experts(got, per_expert)
        y = y.reshape(local, ep, C, -1).transpose(0, 1).reshape(ep * n, -1)
        return self._combine(y.contiguous(), [n] * ep, [n] * ep, during)
