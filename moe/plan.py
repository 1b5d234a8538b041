"""Expert parallelism as a transform of the reference GPT (whole, or a pipeline stage):
each MoE layer keeps the experts of its expert-parallel rank, an index range of the
stacked expert weights (a `Shard` placement along the expert dimension), and routes its
tokens to the others' through `ExpertParallelDispatch`.

Gradients (docs/architecture.md, "Composition"): the router and every dense parameter are
replicated over dp × cp and averaged there like any other. An expert shard is replicated
over the expert-data-parallel group, the ranks holding the same experts in the other EP
groups, of size dp·cp/ep. Its gradient on a rank already sums the contributions of the
tokens of all ep ranks of its EP group (the dispatch's backward brings them), so the
reference gradient (1/(dp·cp)) Σ over all ranks is the sum over the expert-data-parallel
group divided by dp·cp: its average divided by ep, not the average alone (that is ep times
too large).
"""
from __future__ import annotations

import torch
from torch import nn

from model.moe import MoE
from model.placement import Placement, Shard, set_placement

from .dispatch import ExpertParallelDispatch


def expert_parameters(model) -> list:
    """The expert weights of every MoE layer of `model` (sharded by expert parallelism)."""
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def _shard(param: nn.Parameter, name: str, start: int, stop: int) -> nn.Parameter:
    placement = Placement(name, tuple(param.shape), (Shard(0, start, stop, stop - start),))
    t = torch.empty(placement.local_shape, dtype=param.dtype, device="meta") if param.is_meta \
        else placement.local(param.detach()).clone()
    p = nn.Parameter(t)
    set_placement(p, placement)
    return p


def parallelize_experts(model, group):
    """Shard every MoE layer's experts over `group` (ep ranks); returns the model."""
    ep = group.size
    for i, block in model.blocks.items():
        layer = block.mlp
        if not isinstance(layer, MoE):
            continue
        E = layer.config.n_experts
        if E % ep:
            raise ValueError(f"expert parallelism: n_experts={E} is not divisible by ep={ep}")
        local = E // ep
        start = group.rank * local
        for name in ("w_gate", "w_up", "w_down"):
            full = getattr(layer.experts, name)
            setattr(layer.experts, name, _shard(full, f"blocks.{i}.mlp.experts.{name}", start, start + local))
        layer.dispatch = ExpertParallelDispatch(group, E)
    return model
