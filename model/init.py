"""Deterministic, layout-independent initialisation (docs/architecture.md, Contract 4).

Each full parameter is generated from (seed, its reference name) alone, in float64 on
the CPU, so a shard on any layout is exactly the slice of the same full tensor.
Weights are N(0, init_std²); the output projections of each block (attn.wo, mlp.w_down,
the experts' w_down) use init_std/√(2·n_layers) as in GPT-2 (Radford et al. 2019); norm
weights are ones.

Each parameter has its own generator, so they are generated on as many threads as torch's
intra-op setting allows (its CPU random kernels run serially, one per generator, and
release the GIL): the same values in any order. A 1b model's float64 draws take about
half a minute on one core. Under the simulated backend every rank is already a thread and
`launch` sets that setting to one, so each rank generates its own serially.
"""
from __future__ import annotations

import math
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from .config import GPTConfig
from .placement import placement_of


def param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}/{name}".encode())


def init_full_parameter(name: str, shape, config: GPTConfig, seed: int) -> torch.Tensor:
    """The full reference value of parameter `name` (float64, CPU)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float64)
    std = config.init_std
    if name.endswith(("attn.wo.weight", "mlp.w_down.weight", "mlp.experts.w_down", "mlp.shared.w_down.weight")):
        std = std / math.sqrt(2 * config.n_layers)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=g, dtype=torch.float64) * std


def init_weights(model, config: GPTConfig, seed: int, state_dict: dict | None = None,
                 budget: int = 2 << 30) -> None:
    """Fill every parameter of `model` (the reference GPT, possibly pruned or with swapped
    modules) with its part of the full reference parameter, as its placement says: generated
    from (seed, name), or taken from `state_dict` (the reference GPT's, e.g. exported).
    Parameters are filled on threads (the module docstring), in runs whose full float64
    tensors stay within `budget` bytes at once, so a 70b layer's weights do not all sit in
    host memory together."""
    def fill(item):
        name, p = item
        pl = placement_of(name, p)
        full = state_dict[pl.name] if state_dict is not None else init_full_parameter(pl.name, pl.shape, config, seed)
        with torch.no_grad():  # (here, not around the caller: a pool thread starts with gradients enabled)
            p.copy_(pl.local(full))

    params = list(model.named_parameters())
    threads = min(torch.get_num_threads(), len(params))
    if threads <= 1:
        for item in params:
            fill(item)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="init") as pool:
        for batch in _batches(params, budget):
            for _ in pool.map(fill, batch):  # (re-raises a thread's error here)
                pass


def _batches(params: list, budget: int) -> list:
    """Consecutive runs of `params` whose full float64 tensors, made at once, stay within
    `budget` bytes (a run holds at least one): what the threads hold at a time."""
    out, size = [[]], 0
    for name, p in params:
        nbytes = 8 * math.prod(placement_of(name, p).shape)
        if out[-1] and size + nbytes > budget:
            out.append([])
            size = 0
        out[-1].append((name, p))
        size += nbytes
    return out
