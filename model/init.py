"""Deterministic, layout-independent initialisation (docs/architecture.md, Contract 4).

Each full parameter is generated from (seed, its reference name) alone, in float64 on
the CPU, so a shard on any layout is exactly the slice of the same full tensor.
Weights are N(0, init_std²); the output projections of each block (attn.wo, mlp.w_down,
the experts' w_down) use init_std/√(2·n_layers) as in GPT-2 (Radford et al. 2019); norm
weights are ones.
"""
from __future__ import annotations

import math
import zlib

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
    if name.endswith(("attn.wo.weight", "mlp.w_down.weight", "mlp.experts.w_down")):
        std = std / math.sqrt(2 * config.n_layers)
    g = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=g, dtype=torch.float64) * std


@torch.no_grad()
def init_weights(model, config: GPTConfig, seed: int, state_dict: dict | None = None) -> None:
    """Fill every parameter of `model` (the reference GPT, possibly pruned or with swapped
    modules) with its part of the full reference parameter, as its placement says: generated
    from (seed, name), or taken from `state_dict` (the reference GPT's, e.g. exported)."""
    for name, p in model.named_parameters():
        pl = placement_of(name, p)
        full = state_dict[pl.name] if state_dict is not None else init_full_parameter(pl.name, pl.shape, config, seed)
        p.copy_(pl.local(full))
