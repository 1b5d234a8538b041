"""Dropout on the attention probabilities (Srivastava et al. 2014, "Dropout: A Simple Way
to Prevent Neural Networks from Overfitting"), as Megatron-LM applies it after its fused
scale-mask-softmax (`--attention-dropout`, 0.1 by default in the Megatron-LM of Narayanan
et al. 2021): each probability is zeroed with probability `rate` and the rest scaled by
1/(1 − rate).

Where the masks come from. Each rank draws its own (as Megatron-LM's tensor-parallel ranks
do for attention dropout: their heads differ), from a generator of its own:

- on CUDA (the torch backend: one rank per process) torch's fused `native_dropout` kernel,
  drawing from the device's default generator;
- elsewhere (the simulated ranks, threads of one process: torch's default CPU generator
  would be shared by all of them) a `torch.Generator` per attention module; the
  arithmetic runs op by op, priced as torch's fused kernels (forward reads the
  probabilities and writes them and a one-byte mask, backward reads the gradient and the
  mask and writes a gradient);
- on the meta device (planning) no random numbers: shapes only.

Every generator is seeded at the start of each step from (seed, rank, layer, step)
(`seed_dropout`), so the masks are a function of the step, as the data is: a run resumed
from a checkpoint at step k draws what the uninterrupted run drew (Contract 5), with no
generator state to save.

Recomputation (activation checkpointing) must draw the same masks as the first forward:
activation_checkpointing/checkpoint.py saves the state of every generator in `generators`
at a block's forward and replays from it when the block is recomputed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .regions import fused_kernel


class _Dropout(torch.autograd.Function):
    """Dropout with the mask drawn from `generator` (None: no draws, the meta device)."""

    @staticmethod
    def forward(ctx, x, rate: float, generator):
        with fused_kernel(2 * x.nbytes + x.numel(), "native_dropout"):
            if generator is None:
                keep = torch.empty(x.shape, dtype=torch.bool, device=x.device)
            else:
                keep = torch.rand(x.shape, generator=generator, device=x.device) >= rate
            y = x * keep * (1.0 / (1.0 - rate))
        ctx.save_for_backward(keep)
        ctx.rate = rate
        return y

    @staticmethod
    def backward(ctx, g):
        keep, = ctx.saved_tensors
        with fused_kernel(2 * g.nbytes + keep.numel(), "native_dropout_backward"):
            d = g * keep * (1.0 / (1.0 - ctx.rate))
        return d, None, None


def dropout(x, rate: float, generator, training: bool = True):
    """x with each element zeroed with probability `rate`, the rest scaled by 1/(1 − rate);
    x itself when not training or rate is 0."""
    if not training or rate == 0.0:
        return x
    if x.is_cuda:
        return F.dropout(x, rate, training=True)
    return _Dropout.apply(x, rate, None if x.is_meta else generator)


def dropout_generator(device) -> torch.Generator | None:
    """The generator a dropout module on `device` draws from: the device's default one on
    CUDA (torch's fused kernel draws from it), a new one on the CPU, none on meta."""
    device = torch.device(device)
    if device.type == "meta":
        return None
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None
                                             else torch.cuda.current_device()]
    return torch.Generator(device=device)


def generators(module) -> list:
    """The distinct generators the dropout modules under `module` draw from."""
    seen = {}
    for m in module.modules():
        g = getattr(m, "generator", None)
        if isinstance(g, torch.Generator):
            seen[id(g)] = g
    return list(seen.values())


def seed_dropout(model, seed: int, rank: int, step: int = 0) -> None:
    """Seed each dropout module's generator of `model` (one rank's part) from (seed, rank,
    layer, step), so that ranks, layers and steps draw different masks and any step of a run
    draws the same ones however the run got there (resumed or not)."""
    for name, m in model.named_modules():
        g = getattr(m, "generator", None)
        if isinstance(g, torch.Generator):
            layer = int(name.split(".")[1]) if name.startswith("blocks.") else 0
            g.manual_seed(((seed * 1_000_003 + rank) * 10_007 + layer) * 1_000_033 + step)
