"""Activation checkpointing of transformer blocks (Chen et al. 2016, "Training Deep Nets
with Sublinear Memory Cost"; Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models"), through `torch.utils.checkpoint` (non-reentrant):

- "full": a block keeps only its input; its backward first runs its forward again.
  Korthikanti et al. count 2sbh bytes per layer for it (fp16).
- "selective": a block keeps its input and the outputs of its matmuls and attention
  kernel (policy.py); backward recomputes the element-wise and normalisation ops from
  them.
- "selective-op": torchtitan's op-level policy: as "selective", but every second matmul
  of the block is recomputed too (policy.py).

The transform sets `block.recompute` on each block of a model part (the reference GPT's
Block runs its body through it), after the tensor, context and expert transforms (whose
module swaps and hooks are part of the body, so recomputation repeats their collectives)
and before data parallelism (whose hooks sit on the block and on the parameters, outside
the checkpointed body: ZeRO-3 gathers a block's parameters before its backward, and so
before its recomputation).

Recomputation must not count twice what a forward records: modules with a `recomputing`
attribute see it set while their block's forward runs again (the MoE layers, whose
forward adds up routing statistics; ZeRO-3's expert units, which keep their gathered
parameters instead of freeing them and prefetching the next unit).

Modules with a `checkpointed` attribute learn whether their block is checkpointed (the MoE
layers, whose compiled region is not replayed as CUDA graphs inside a checkpointed block:
model/compiled.py, `region`).

Memory: autograd's saved-tensor hooks (the simulator's `MemoryTracker`) see what the
checkpoint keeps of the block's inputs, but not the outputs the selective policy keeps
(they are held by the checkpoint, outside autograd), so those are counted here, from
the forward until the block's backward has freed them. The activations of the one block
being recomputed, held by the checkpoint outside the hooks too, the tracker counts as the
recomputation makes them, until they are freed (`MemoryTracker.watch`).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from model.dropout import generators
from model.regions import activation_tracker, selective_checkpoint

from . import MODES
from .policy import SelectivePolicy


class _CountKept(TorchDispatchMode):
    """Above the selective policy's caching mode during a checkpointed forward: gives the
    memory tracker a handle for each output the policy keeps, held by the region."""

    def __init__(self, region, tracker):
        super().__init__()
        self.region, self.tracker = region, tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        region = self.region
        if region.policy.saves(func):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    region.kept.append(self.tracker.hold(t))
        return out


class _Region:
    """One checkpointed call of a block: the function torch.utils.checkpoint runs, once in
    forward and again (recomputation) in backward."""

    def __init__(self, body, modules, policy, generators):
        self.body, self.modules, self.policy = body, modules, policy
        self.ran = False
        self.kept = []  # memory handles of the outputs the selective policy keeps
        # the dropout generators' states at the forward, for recomputation to draw the same masks
        self.rng = [(g, g.get_state()) for g in generators]

    def __call__(self, *args):
        if not self.ran:
            self.ran = True
            with self._dispatched():
                return self.body(*args)
        for handle in self.kept:  # recomputation takes the kept outputs back: they count
            handle.tracker.watch(handle.tensor)  # until the block's backward frees them
        self.kept.clear()
        with _recomputing(self.modules), _replaying(self.rng), self._dispatched():
            return self.body(*args)

    def _dispatched(self):
        """Under a selective policy torch's checkpoint runs each op of the forward and of the
        recomputation through its Python dispatch mode, a host cost per op (the simulator's
        `selective_checkpoint`); under full recomputation no mode is pushed."""
        return selective_checkpoint() if self.policy is not None else contextlib.nullcontext()

    def contexts(self):
        forward, recompute = create_selective_checkpoint_contexts(self.policy)
        tracker = activation_tracker()  # the rank's activations tracked now (model/regions.py), or None
        if tracker is None:
            return forward, recompute
        return _both(forward, _CountKept(self, tracker)), recompute


@contextlib.contextmanager
def _both(first, second):
    """The policy's caching mode, and the counting mode on top of it."""
    with first, second:
        yield


@contextlib.contextmanager
def _replaying(rng):
    """Each generator set to its state at the forward, and back to where it is now after."""
    now = [g.get_state() for g, _ in rng]
    for g, state in rng:
        g.set_state(state)
    try:
        yield
    finally:
        for (g, _), state in zip(rng, now):
            g.set_state(state)


@contextlib.contextmanager
def _recomputing(modules):
    for m in modules:
        m.recomputing = True
    try:
        yield
    finally:
        for m in modules:
            m.recomputing = False


class Recompute:
    """`block.recompute`: runs the block's body(x, cos, sin) under torch.utils.checkpoint.
    Without gradients (evaluation) the body runs plainly. Random state: the model's only
    random op, attention dropout, draws from its modules' generators (model/dropout.py; on
    CUDA the device's default one); their states at the forward are saved and replayed for
    the recomputation, so it draws the forward's masks (torch's own RNG saving is off)."""

    def __init__(self, mode: str, block):
        if mode not in ("full", "selective", "selective-op"):
            raise ValueError(f"activation checkpointing mode must be 'full', 'selective' or 'selective-op', "
                             f"not {mode!r}")
        self.block = block
        self.selective = mode != "full"
        self.every = 2 if mode == "selective-op" else None  # (torchtitan recomputes every second matmul)

    def __call__(self, body, *args):
        if not torch.is_grad_enabled():
            return body(*args)
        # (looked up per call: data parallelism, applied after this transform, marks its units)
        modules = [m for m in self.block.modules() if hasattr(m, "recomputing")]
        policy = SelectivePolicy(self.every) if self.selective else None  # (one per call: it counts matmuls)
        region = _Region(body, modules, policy, generators(self.block))
        context_fn = region.contexts if policy is not None else noop_context_fn
        return checkpoint(region, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn)


def checkpoint_blocks(model, mode: str) -> None:
    """Checkpoint every block of `model` (a reference GPT or a pipeline stage's part) in
    `mode` ("none" leaves it as it is)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing must be one of {', '.join(MODES)}, not {mode!r}")
    for block in model.blocks.values():
        block.recompute = None if mode == "none" else Recompute(mode, block)
        for m in block.modules():  # (the MoE layers: no CUDA graphs inside a checkpointed block)
            if hasattr(m, "checkpointed"):
                m.checkpointed = block.recompute is not None
