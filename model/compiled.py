"""Chains of small ops that a GPU runs through torch.compile (Inductor fuses them into a few
kernels, and their host cost is one call instead of one per op), where the CPU, the meta
device (plans) and the float64 check run them op by op, the same arithmetic in another
number of kernels. The compiled function is made once per Python function, on first use,
without dynamic shapes (each shape it meets is compiled once).

A compiled region is compiled both ways: AOTAutograd (Ansel et al. 2024, "PyTorch 2") traces
its backward too, which a GPU runs as one compiled graph launched from one call. A plan runs
the region on the meta device, op by op, and prices it as the GPU runs it (`region`): its
forward as one kernel moving the bytes the caller gives (`fused_kernel`), its backward as
the kernels of one graph, each op's device time its own and the host's one call
(`compiled_kernels`), where an eager backward would cost the host one launch per op."""
from __future__ import annotations

import functools

import torch

from .regions import compiled_kernels, fused_kernel


@functools.cache
def compiled(fn):
    """`fn` through torch.compile."""
    return torch.compile(fn, dynamic=False)


def as_dtype(t, dtype):
    """`t` in `dtype`: `t` itself where it is in it already, without the `.to()` that would
    return it. torch 2.11's Dynamo differentiates an autograd.Function whose forward returns
    such a no-op `.to()` of one of its own results wrongly (`--compile` on float32 or float64:
    the gradients of every layer below it, up to 100% off; torch 2.13 does not), so the
    Functions traced into a compiled block (FusedRMSNorm, ScaledCausalSoftmax: model/gpt.py;
    ring attention's: sequence_parallel/ring.py) cast only what changes dtype."""
    return t if t.dtype == dtype else t.to(dtype)


def fused_on(fn, t):
    """`fn` as it runs on `t`'s device: compiled on CUDA, op by op elsewhere; as it is inside
    code torch.compile traces already (`--compile`: traced into the caller's graph)."""
    return compiled(fn) if t.is_cuda and not torch.compiler.is_compiling() else fn


def region(name: str, io_bytes: int, fn, *args, checkpointed: bool = False, graph=None):
    """fn(*args) as a GPU runs it: compiled on CUDA (`fused_on`); priced by the simulator as
    one kernel moving io_bytes (a plan's meta ranks, and CPU ranks with simulated time, run
    its ops one by one); on the meta device its backward priced as one compiled graph's
    (`_CompiledBackward`), elsewhere op by op (the CPU's arithmetic, the float64 check's
    included, left as it is), and so inside an activation-checkpointed block
    (`checkpointed`): torch.utils.checkpoint recomputes what the graph saves when its
    backward first unpacks it, and an autograd graph built inside a custom Function's
    forward would be recomputed apart from the block's (twice, or refused under a selective
    policy). `graph`: the call site's CUDA graphs (model/cuda_graphs.py), which replay the
    compiled region on a GPU, outside a checkpointed block."""
    t = args[0]
    with fused_kernel(io_bytes, name):
        if t.is_meta and torch.is_grad_enabled() and not checkpointed:
            return _CompiledBackward.apply(fn, name, *args)
        if graph is not None and t.is_cuda and not checkpointed:
            return graph(fn, *args)
        return fused_on(fn, t)(*args)


class _CompiledBackward(torch.autograd.Function):
    """fn(*args) with its own autograd graph (built inside, on the inputs detached), whose
    backward runs that graph's backward ops inside `compiled_kernels`: what a compiled
    region's backward costs on a GPU, priced on the meta device. Outputs that are not
    floating point (counts) or need no gradient pass through."""

    @staticmethod
    def forward(ctx, fn, name, *args):
        inner = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
        with torch.enable_grad():
            out = fn(*inner)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.name, ctx.n_args = name, len(args)
        ctx.inputs = [(i, a) for i, a in enumerate(inner) if isinstance(a, torch.Tensor) and a.requires_grad]
        ctx.outputs = [(j, o) for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor) and not o.requires_grad])
        got = tuple(o.detach() if isinstance(o, torch.Tensor) and o.requires_grad else o for o in outs)
        return got if isinstance(out, tuple) else got[0]

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(o, grads[j]) for j, o in ctx.outputs if grads[j] is not None]
        out = [None] * ctx.n_args
        if pairs and ctx.inputs:
            with compiled_kernels(f"{ctx.name}_backward"):
                got = torch.autograd.grad([o for o, _ in pairs], [a for _, a in ctx.inputs], [g for _, g in pairs],
                                          allow_unused=True)
            for (i, _), g in zip(ctx.inputs, got):
                out[i] = g
        ctx.inputs = ctx.outputs = None
        return (None, None, *out)
