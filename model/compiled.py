"""Chains of small ops that a GPU runs through torch.compile (Inductor fuses them into a few
kernels, and their host cost is one call instead of one per op), where the CPU, the meta
device (plans) and the float64 check run them op by op, the same arithmetic in another
number of kernels. The compiled function is made once per Python function, on first use,
without dynamic shapes (each shape it meets is compiled once)."""
from __future__ import annotations

import functools

import torch


@functools.cache
def compiled(fn):
    """`fn` through torch.compile."""
    return torch.compile(fn, dynamic=False)


def fused_on(fn, t):
    """`fn` as it runs on `t`'s device: compiled on CUDA, op by op elsewhere; as it is inside
    code torch.compile traces already (`--compile`: traced into the caller's graph)."""
    return compiled(fn) if t.is_cuda and not torch.compiler.is_compiling() else fn
