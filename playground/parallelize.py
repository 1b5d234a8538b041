"""`parallelize`: the strategies of a layout applied to the one reference GPT, as
transforms in one fixed order (in the style of torchtitan's `parallelize_llama`;
docs/architecture.md, "Composition"):

1. pipeline split (pipeline.split_stages): the meta-device model is pruned to the stages
   this rank holds; every later transform applies to each model part. It comes first
   because it makes the parts (a deep copy per chunk keeps no attribute or hook that a
   transform attaches), and it commutes with the module swaps that follow;
2. tensor (and sequence) parallelism (tensor_parallel.parallelize_tensor): module swaps
   by a name plan;
3. context parallelism (sequence_parallel.parallelize_context): every block's attention
   core swapped for ring attention or Ulysses, the model told its tokens' positions;
4. expert parallelism (moe.parallelize_experts): each MoE layer keeps its EP rank's
   experts and dispatches tokens over all-to-alls; every MoE layer counts its load-balancing
   statistics over dp × cp;
5. activation checkpointing (activation_checkpointing.checkpoint_blocks): each block's
   body runs under torch.utils.checkpoint, full or selective; 6. compile (`compile_blocks`):
   each block's body through torch.compile (the hooks of data parallelism stay outside it);
then every part is materialized on the device (each local tensor from its placement);
7. data parallelism (playground/data_parallel.py): each transform hands it the parameter
   groups it made, with the group their gradients are averaged over (the dense parameters
   over dp × cp, or under hybrid sharding sharded within dp_shard × cp and replicated
   across dp_replicate; the expert shards over their expert-data-parallel group, scaled),
   and one function wraps them: DDP, or ZeRO by stage.

The training loop talks to the result through `ParallelModel` only: `run_step` (the
microbatches of one step, forward and backward, by gradient accumulation or by the
pipeline schedule), `step` (the optimizer), `pieces` (every local tensor with its
placement, Contract 4) and `state_tensors` (model states by category, for memory).
Adding a strategy means adding a transform here, not a class per combination.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from activation_checkpointing import checkpoint_blocks
from model.gpt import CrossEntropy
from moe import expert_parameters, parallelize_experts
from pipeline import PipelineExecutor, build_schedule, split_stages
from sequence_parallel import parallelize_context, shard_sequence
from tensor_parallel import parallelize_tensor

from model.moe import MoEStats

from .data_parallel import ParamGroup, data_parallel, data_parallel_group


# -- how a step runs ---------------------------------------------------------------------------
class GradientAccumulation:
    """Forward and backward of each microbatch in turn, gradients accumulated; the
    data-parallel wrapper reduces them at the last one (`no_sync` before)."""

    def __init__(self, model, sync, autocast):
        self.model, self.sync, self.autocast = model, sync, autocast

    def run(self, inputs, targets, track) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64, device=inputs[0].device)
        for i, (x, y) in enumerate(zip(inputs, targets)):
            last = i == len(inputs) - 1
            with contextlib.nullcontext() if last else self.sync.no_sync(), track():  # forward and backward
                with self.autocast:
                    loss = self.model(x, y) / len(inputs)
                self.sync.scale_loss(loss).backward()
            total += loss.detach().double()
            del loss  # the graph, and the activations it saved, go now
        return total


class PipelineRunner:
    """The microbatches of a step through the pipeline schedule; the loss, known on the last
    stage's rank, is broadcast so every rank of the pipeline reports it."""

    def __init__(self, executor: PipelineExecutor, pp_group, autocast):
        self.executor, self.pp, self.autocast = executor, pp_group, autocast

    def run(self, inputs, targets, track) -> torch.Tensor:
        with track(), self.autocast:
            total = self.executor.run(inputs, targets)
        self.pp.broadcast(total, src=self.pp.size - 1, label="metrics.loss_pp")
        return total


@dataclass
class ParallelModel:
    """What the training loop drives: this rank's model parts and their data-parallel
    wrappers, how a step runs, and the optimizer."""
    parts: list  # the model chunks this rank holds (one, or one per virtual pipeline stage)
    syncs: list  # per part: its data-parallel wrapper (no_sync, scale_loss)
    runner: object  # GradientAccumulation or PipelineRunner: run(inputs, targets, track) -> loss
    optimizer: object  # ReplicatedAdamW or ShardedOptimizer: step, pieces, state_tensors
    positions: torch.Tensor | None = None  # context parallelism: the sequence positions this rank holds
    pp_group: object = None  # with a pipeline: to add up the stages' MoE losses
    slices_group: object = None  # MoE under sequence parallelism: the TP ranks routing slices of one sequence

    @property
    def params(self) -> list:
        """The local parameters (not activations, for the memory tracker)."""
        return [p for m in self.parts for p in m.parameters()]

    def run_step(self, micro, track) -> torch.Tensor:
        """Forward and backward of the step's microbatches (rows of seq_len + 1 tokens: the
        inputs and the targets shifted by one; under context parallelism this rank's
        positions of both); returns this rank's share of the mean loss (0 off the last
        pipeline stage)."""
        inputs, targets = [mb[:, :-1] for mb in micro], [mb[:, 1:] for mb in micro]
        if self.positions is not None:
            inputs = [shard_sequence(x, self.positions) for x in inputs]
            targets = [shard_sequence(y, self.positions) for y in targets]
        layers = self.moe_layers
        slices = self.slices_group.size if self.slices_group is not None else 1
        for layer in layers:  # a microbatch's auxiliary losses weigh 1/m as its cross-entropy (1/tp per slice)
            layer.aux_scale, layer.stats = 1.0 / (len(micro) * slices), MoEStats()
        total = self.runner.run(inputs, targets, track)
        if layers or self.pp_group is not None:
            moe = torch.tensor(sum(layer.stats.aux + layer.stats.z for layer in layers), dtype=torch.float64,
                               device=total.device)
            if self.slices_group is not None:  # the TP ranks' slices, to the reported loss on each of them
                self.slices_group.all_reduce(moe, label="metrics.moe_tp")
            if self.pp_group is not None:  # the stages' MoE losses, to the reported loss on every stage
                self.pp_group.all_reduce(moe, label="metrics.moe_pp")
            total = total + moe
        return total

    @property
    def moe_layers(self) -> list:
        return [layer for m in self.parts for layer in m.moe_layers()]

    def step(self) -> None:
        self.optimizer.step()

    def pieces(self, what: str) -> list:
        """[(Placement, CPU float64 copy)] of the weights ("param") or the reduced gradients
        ("grad") this rank holds."""
        return self.optimizer.pieces(what)

    def state_tensors(self) -> dict:
        return self.optimizer.state_tensors()

    def state_pieces(self) -> list:
        """[(kind, Placement, tensor)] this rank holds: weights and optimizer moments (checkpoints)."""
        return self.optimizer.state_pieces()

    def load_state(self, fill, step: int) -> None:
        """Set every local weight and moment from `fill(kind, placement)`; AdamW's step count."""
        self.optimizer.load_state(fill, step)


def compile_blocks(model, backend: str = "inductor") -> None:
    """torch.compile each block's body (its attention and MLP, with the tensor- and context-
    parallel modules inside), as torchtitan compiles per block: one graph serves every block
    (their code is the same, the modules are inputs). The block's own call, and the hooks
    data parallelism puts on it, stay eager. The plain cross-entropy of a part with the head
    is compiled too: its float32 upcast, log-softmax and their backward then run as a few
    fused kernels over the logits instead of writing and reading float32 logits several
    times (a vocabulary-parallel loss, with its collectives, stays eager)."""
    for block in model.blocks.values():
        block.body = torch.compile(block.body, backend=backend)
    if model.lm_head is not None and type(model.loss) is CrossEntropy:
        model.loss = torch.compile(model.loss, backend=backend)


def expert_mesh(mesh, layout):
    """The same ranks as `mesh`, with dp × cp seen as (edp, ep): expert-parallel groups of ep
    neighbouring dp × cp ranks, and the expert-data-parallel groups across them."""
    from collectives import Mesh
    return Mesh(mesh.parent, **expert_mesh_axes(layout))


def expert_mesh_axes(layout) -> dict:
    ep = max(1, layout.ep)
    return {"pp": layout.pp, "edp": layout.dp * layout.cp // ep, "ep": ep, "tp": layout.tp}


def parallelize(model, mesh, run, device, memory=None, unit_costs=None, state_dict=None) -> ParallelModel:
    """Apply `run.layout` to `model` (the reference GPT on the meta device) on this rank of
    `mesh`; `memory` (a MemoryTracker) is told of communication buffers; `unit_costs`
    charges fixed pipeline stage costs on the simulated clock (bubble measurements);
    `state_dict` (the reference GPT's) gives the initial weights instead of (seed, name)."""
    layout, cfg = run.layout, run.model
    dp, tp = data_parallel_group(mesh, layout), mesh.group("tp")
    # 1. the pipeline split
    if layout.pp > 1:
        chunks = split_stages(model, layout.pp, mesh.group("pp").rank, layout.virtual_stages, layout.stage_layers)
    else:
        chunks = [(0, model)]
    stages, parts = [s for s, _ in chunks], [m for _, m in chunks]
    # 2. tensor and sequence parallelism
    if layout.tp > 1:
        for part in parts:
            parallelize_tensor(part, tp, layout.sequence_parallel)
    # 3. context parallelism
    if layout.cp > 1:
        for part in parts:
            parallelize_context(part, mesh.group("cp"), layout.cp_impl, layout.cp_balance)
    # 4. expert parallelism
    sp_slices = layout.tp if layout.sequence_parallel else 1  # TP ranks holding different tokens
    split_experts = layout.ep > 1 or (cfg.n_experts and sp_slices > 1)  # experts need their own reduction
    if split_experts:
        ep_mesh = expert_mesh(mesh, layout)  # (every rank makes these groups, in this order)
        ep_group, edp_group = ep_mesh.group("ep"), ep_mesh.group("edp", "tp")
        if layout.ep > 1:
            for part in parts:
                parallelize_experts(part, ep_group)
    tokens = mesh.group("dp", "cp", "tp") if cfg.n_experts and sp_slices > 1 else dp  # token-distinct ranks
    for part in parts:
        for layer in part.moe_layers():
            layer.stats_group = tokens if tokens.size > 1 else None  # f_i counted over the microbatch's ranks
    # 5. activation checkpointing, 6. compile
    if layout.ac != "none":
        for part in parts:
            checkpoint_blocks(part, layout.ac, memory)
    if run.compile:
        for part in parts:
            compile_blocks(part)
    for part in parts:
        part.materialize(device, run.seed, state_dict, rank=mesh.rank)
    # 7. data parallelism on each part: the dense parameters over dp × cp (under hybrid
    # sharding, sharded within dp_shard × cp and replicated across dp_replicate); the expert
    # shards over the expert-data-parallel group (× tp slices), their averaged gradients
    # scaled by tp/ep: the sum over that group over dp·cp (moe/plan.py)
    shard, replicate = ((mesh.group("dp_shard", "cp"), mesh.group("dp_replicate")) if layout.dp_replicate > 1
                        else (dp, None))
    groups = []
    for part in parts:
        mine = expert_parameters(part) if split_experts else []
        groups.append([ParamGroup(shard, replicate=replicate)]
                      + ([ParamGroup(edp_group, params=mine, scale=sp_slices / layout.ep, name="experts",
                                     units=[m.experts for m in part.moe_layers()])] if mine else []))
    syncs, optimizer, autocast, hidden_dtype = data_parallel(parts, stages, groups, run, device, memory)
    if layout.pp > 1:
        pp = mesh.group("pp")
        split = layout.tp if layout.sequence_parallel else 1  # SP: stages pass the rank's slice of the sequence
        # (tokens are already this cp rank's share of the sequence)

        def hidden_shape(tokens):
            return tokens.shape[0], tokens.shape[1] // split, cfg.d_model
        def schedule(m):
            return build_schedule(layout.schedule, layout.pp, m, layout.virtual_stages)[pp.rank]
        executor = PipelineExecutor(parts, pp, schedule(layout.microbatches), hidden_shape=hidden_shape,
                                    virtual_stages=layout.virtual_stages, syncs=syncs, unit_costs=unit_costs,
                                    hidden_dtype=hidden_dtype, memory=memory, schedule=schedule)
        runner = PipelineRunner(executor, pp, autocast)
    else:
        runner = GradientAccumulation(parts[0], syncs[0], autocast)
    return ParallelModel(parts, syncs, runner, optimizer, parts[0].positions,
                         mesh.group("pp") if layout.pp > 1 and cfg.n_experts else None,
                         tp if cfg.n_experts and sp_slices > 1 else None)
