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
too large). Under sequence parallelism the tp ranks of a group route different slices of
the same tokens, so even at ep 1 the experts' gradients are summed over tp as well: the
expert-data-parallel group is then (edp, tp), the scale tp/ep.

`parallelize_moe` is the transform the composition applies (docs/architecture.md,
"Composition", step 4): it shards the experts, says over which ranks each MoE layer counts
its load (f_i), and hands back what the later steps need from it: the experts' parameter
group for data parallelism (`ExpertShards`) and the auxiliary losses to add to the reported
loss (`AuxLosses`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from collectives import Mesh
from model.moe import MoE, MoEStats
from model.placement import Placement, Shard, set_placement

from .dispatch import ExpertParallelDispatch
from .mesh_axes import expert_mesh_axes


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


@dataclass
class ExpertShards:
    """The experts' parameters of a part, for data parallelism: their gradients are averaged
    over the expert-data-parallel `group` and multiplied by `scale` (tp slices / ep)."""
    group: object
    params: list
    scale: float
    units: list  # ZeRO's units: each block with experts, in forward order (its experts' parameters)
    name: str = "experts"
    replicate: object = None


class AuxLosses:
    """The MoE layers' auxiliary losses of a step, added to the reported loss: each layer's
    calls weigh 1/microbatches (1/tp per sequence-parallel slice), and the sum is all-reduced
    over the tp ranks routing slices of one sequence and over the pipeline's stages, so every
    rank reports the whole loss."""

    def __init__(self, parts: list, slices_group=None, pp_group=None):
        self.parts, self.slices, self.pp = parts, slices_group, pp_group

    def begin(self, microbatches: int) -> None:
        slices = self.slices.size if self.slices is not None else 1
        for m in self.parts:
            for layer in m.moe_layers():
                layer.aux_scale, layer.stats = 1.0 / (microbatches * slices), MoEStats()

    def total(self, device) -> torch.Tensor:
        moe = torch.zeros((), dtype=torch.float64, device=device)
        for m in self.parts:  # (the layers' values stay on the device: MoEStats)
            for layer in m.moe_layers():
                moe = moe + layer.stats.loss(device)
        if self.slices is not None:  # the TP ranks' slices, to the reported loss on each of them
            self.slices.all_reduce(moe, label="metrics.moe_tp")
        if self.pp is not None:  # the stages' MoE losses, to the reported loss on every stage
            self.pp.all_reduce(moe, label="metrics.moe_pp")
        return moe


class MoEParallel:
    """What `parallelize_moe` hands the composition: `param_groups(part)` (after the part is
    materialized) and the loss term `aux`."""

    def __init__(self, edp_group, scale: float, aux: AuxLosses):
        self.edp, self.scale, self.aux = edp_group, scale, aux

    def param_groups(self, part) -> list:
        mine = expert_parameters(part) if self.edp is not None else []
        # ZeRO's units: the blocks holding experts (their experts' parameters, the dense ones being
        # another engine's), so that ZeRO-3 gathers them around the block's call, outside its
        # checkpointed body: inside, the forward (prefetched) and the recomputation (gathered on
        # demand) would run different ops, which selective checkpointing refuses
        blocks = [b for b in part.blocks.values() if isinstance(b.mlp, MoE)]
        return [ExpertShards(self.edp, mine, self.scale, blocks)] if mine else []


def parallelize_moe(parts: list, mesh, layout) -> MoEParallel:
    """Expert parallelism on the model parts of this rank of `mesh` (`layout`: its dp, cp, tp,
    ep, pp and sequence_parallel): the experts sharded over ep, the load statistics counted over
    the ranks that see different tokens of a microbatch."""
    slices = layout.tp if layout.sequence_parallel else 1  # TP ranks holding different tokens
    edp, scale = None, 1.0
    if layout.ep > 1 or slices > 1:  # the experts need a reduction of their own
        ep_mesh = Mesh(mesh.parent, **expert_mesh_axes(layout))  # (every rank makes these groups, in this order)
        ep_group, edp = ep_mesh.group("ep"), ep_mesh.group("edp", "tp")
        scale = slices / layout.ep
        if layout.ep > 1:
            for part in parts:
                parallelize_experts(part, ep_group)
    axes = ("dp", "cp", "tp") if slices > 1 else (("dp", "cp") if layout.cp > 1 else ("dp",))
    tokens = mesh.group(*axes)  # the ranks holding different tokens of a microbatch
    # the ranks holding other parts of the same sequences (the sequence-wise balance loss's counts)
    same = [a for a in axes if a != "dp"]
    per_sequence = parts[0].config.aux_loss == "sequence" and (layout.cp > 1 or slices > 1)
    sequences = mesh.group(*same) if per_sequence else None
    for part in parts:
        for layer in part.moe_layers():
            layer.stats_group = tokens if tokens.size > 1 else None  # f_i counted over the microbatch's ranks
            layer.sequence_group = sequences
    aux = AuxLosses(parts, mesh.group("tp") if slices > 1 else None, mesh.group("pp") if layout.pp > 1 else None)
    return MoEParallel(edp, scale, aux)
