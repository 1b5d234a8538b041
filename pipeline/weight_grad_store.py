"""Deferred weight gradients for split backward (zero-bubble pipelines, Qi et al. 2023,
"Zero Bubble Pipeline Parallelism", section 2: B = I + W).

A linear layer's backward is two GEMMs: the input gradient dX = dY·W, which the previous
stage waits for, and the weight gradient dW = dYᵀ·X, which nobody waits for. In split
mode every linear layer of a pipeline chunk runs through `DeferredLinear`: its backward
(the I pass) computes dX only and leaves (X, dY, W) in the chunk's `WeightGradStore`; the
W pass then computes every stored dW, one GEMM per layer, and accumulates them all with
one autograd call (so the gradient hooks of data parallelism fire as for any backward).
This is how the paper's own implementation splits Megatron's linear layers; the
alternative, one autograd call per layer from that layer's output gradient, costs an
engine launch per layer and keeps the whole graph alive between I and W.

Parameters outside linear layers (norm weights, embeddings, experts' batched weights)
receive their gradients in the I pass, as in a plain backward: they are a sliver of the
work, and the graph can be freed as soon as I is done.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from model.regions import activation_tracker


class DeferredLinear(torch.autograd.Function):
    """y = x·Wᵀ (+ b); backward returns dX and leaves dW (and db) to the store's W pass.
    The weight and bias enter detached, with the parameters themselves as `params`: autograd
    has no edge to them here, so a backward through the layer (I) neither accumulates nor
    announces their gradients (data parallelism's hooks fire in W, with the gradients)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, params):
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.params = store, params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        # detached: a saved input comes back with its grad_fn, which would keep the forward's
        # graph, and through it the stage's received input, alive until W
        ctx.store.defer(x.detach(), g, *ctx.params)
        ctx.store = ctx.params = None
        # the same GEMM autograd runs for the input of a linear layer
        dx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        return dx, None, None, None, None


class _DeferLinears(TorchFunctionMode):
    """Inside one module's forward: route F.linear on that module's weight through
    DeferredLinear (modules with their own forward, like Megatron's parallel linears, keep
    their communication: only the GEMM changes)."""

    def __init__(self, store, weight):
        super().__init__()
        self.store, self.weight = store, weight

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and args[1] is self.weight and torch.is_grad_enabled():
            weight, bias = args[1], args[2] if len(args) > 2 else kwargs.get("bias")
            return DeferredLinear.apply(args[0], weight.detach(), None if bias is None else bias.detach(), self.store,
                                        (weight, bias))
        return func(*args, **kwargs)


class _Deferred(list):
    """One I pass's deferred layers, with the memory tracker's handles on their inputs."""

    def __init__(self):
        super().__init__()
        self.held = []


class WeightGradStore:
    """The weight gradients one pipeline rank has deferred: `collect()` opens a list for
    one I pass and returns it; `apply(entries)` is the W pass. Where the rank's activations
    are tracked (model.regions.activation_tracker), the input X and the output gradient dY
    each deferred layer keeps for W count as activations until W has run: autograd let go of
    them after I, the store has not."""

    def __init__(self):
        self._open = None

    def install(self, module) -> int:
        """Put every linear layer (a module whose direct `weight` is a 2-D parameter that
        requires grad) of `module` in split mode; returns how many. A plain nn.Linear calls
        DeferredLinear directly; other modules (Megatron's parallel linears, a router) run
        their own forward with their F.linear routed to it."""
        n = 0
        for m in module.modules():
            w = getattr(m, "weight", None)
            if isinstance(w, torch.nn.Parameter) and w.dim() == 2 and w.requires_grad \
                    and not isinstance(m, torch.nn.Embedding):
                if type(m) is torch.nn.Linear:
                    m.forward = functools.partial(self._linear, m)
                else:
                    m.forward = functools.partial(self._forward, m, m.forward)
                n += 1
        return n

    def _linear(self, module, x):
        w, b = module.weight, module.bias
        if not torch.is_grad_enabled():
            return F.linear(x, w, b)
        return DeferredLinear.apply(x, w.detach(), None if b is None else b.detach(), self, (w, b))

    def _forward(self, module, forward, *args, **kwargs):
        with _DeferLinears(self, module.weight):
            return forward(*args, **kwargs)

    def defer(self, x, g, weight, bias) -> None:
        if self._open is None:
            raise RuntimeError("a deferred linear layer ran backward outside the pipeline's I pass")
        self._open.append((x, g, weight, bias))
        tracker = activation_tracker()
        if tracker is not None:
            # dY too: made in backward it counted as a temporary, but the stage's output gradient
            # that a last linear layer gets as it came (a residual add passes it on) was made by no op
            self._open.held.extend((tracker.hold(x), tracker.hold(g)))

    @contextlib.contextmanager
    def collect(self):
        """A context for one I pass; yields the list its linear layers fill (its handles on
        the inputs go when the list does, after W)."""
        self._open = _Deferred()
        try:
            yield self._open
        finally:
            self._open = None

    @staticmethod
    def apply(entries: list) -> bool:
        """The W pass: every deferred layer's dW in one backward call. Returns False if
        there was nothing to apply. The list is emptied: its inputs X and output gradients
        dY are freed here, whoever still holds the list (a caller's variable kept them
        alive until the next I pass: 0.7 GiB more at the peak of a 1b stage, measured on
        an H200 and found by simulator/live_bytes.py)."""
        params = [t for _, _, weight, bias in entries for t in (weight, bias) if t is not None]
        if params:
            root = _WeightGradients.apply(entries, *params)
            root.backward(root)  # the root's gradient is never read: no kernel to make one
        entries.clear()
        if isinstance(entries, _Deferred):
            entries.held.clear()  # the inputs are W's no longer
        return bool(params)


class _WeightGradients(torch.autograd.Function):
    """A root whose backward is the W pass: dW = dYᵀ·X (the GEMM autograd runs for a
    linear layer's weight) and db = Σ dY for each deferred layer, handed to autograd as the
    gradients of the parameters, so that they are accumulated (the gradient taken over,
    not copied) and data parallelism's hooks fire, as in any backward."""

    @staticmethod
    def forward(ctx, entries, *params):
        ctx.entries = entries
        return params[0].new_empty(())

    @staticmethod
    def backward(ctx, _):
        grads = []
        for x, g, _, bias in ctx.entries:
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            grads.append(g2.t().mm(x2))
            if bias is not None:
                grads.append(g2.sum(0))
        ctx.entries = None
        return (None, *grads)
