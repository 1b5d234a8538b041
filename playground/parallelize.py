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
4. expert parallelism (moe.parallelize_moe): each MoE layer keeps its EP rank's experts
   and dispatches tokens over all-to-alls, and counts its load-balancing statistics over the
   ranks holding different tokens; the transform hands back the experts' parameter group
   and the auxiliary losses as a loss term;
5. activation checkpointing (activation_checkpointing.checkpoint_blocks): each block's
   body runs under torch.utils.checkpoint, full or selective; 6. compile (`compile_blocks`):
   each block's body through torch.compile (the hooks of data parallelism stay outside it);
then every part is materialized on the device (each local tensor from its placement);
7. data parallelism (playground/data_parallel.py): each transform hands it the parameter
   groups it made, with the group their gradients are averaged over (the dense parameters
   over dp × cp, or under hybrid sharding sharded within dp_shard × cp and replicated
   across dp_replicate; the expert shards as the MoE transform hands them), and one
   function wraps them: DDP, or ZeRO by stage.

The training loop talks to the result through `ParallelModel` only: `run_step` (the
microbatches of one step, forward and backward, by gradient accumulation or by the
pipeline schedule), `step` (the optimizer), `pieces` (every local tensor with its
placement, Contract 4) and `state_tensors` (model states by category, for memory).
Adding a strategy means adding a transform here, not a class per combination.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from activation_checkpointing import checkpoint_blocks
from model.cuda_graphs import CudaGraphs
from model.gpt import CrossEntropy
from model.moe import grouped_mm_applies
from model.placement import Placement
from moe import parallelize_moe
from pipeline import PipelineExecutor, build_schedule, split_stages
from sequence_parallel import parallelize_context, shard_sequence
from tensor_parallel import parallelize_tensor

from .data_parallel import ParamGroup, data_parallel, data_parallel_group, model_groups


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
    loss_terms: list = field(default_factory=list)  # begin(microbatches), total(device): added to the loss

    @property
    def params(self) -> list:
        """The local parameters (not activations, for the memory tracker)."""
        return [p for m in self.parts for p in m.parameters()]

    def run_step(self, micro, track) -> torch.Tensor:
        """Forward and backward of the step's microbatches (rows of seq_len + 1 tokens: the
        inputs and the targets shifted by one; under context parallelism this rank's
        positions of both); returns this rank's share of the mean loss (0 off the last
        pipeline stage), with the transforms' loss terms (the MoE auxiliary losses)."""
        inputs, targets = [mb[:, :-1] for mb in micro], [mb[:, 1:] for mb in micro]
        if self.positions is not None:
            inputs = [shard_sequence(x, self.positions) for x in inputs]
            targets = [shard_sequence(y, self.positions) for y in targets]
        for term in self.loss_terms:
            term.begin(len(micro))
        scalers = getattr(self.optimizer, "scalers", [])
        for layer in self.moe_layers:  # (fp16: the auxiliary losses' gradients scaled as the loss's)
            layer.loss_scale = scalers[0].scale if scalers else 1.0
        total = self.runner.run(inputs, targets, track)
        for term in self.loss_terms:
            total = total + term.total(total.device)
        return total

    @property
    def moe_layers(self) -> list:
        return [layer for m in self.parts for layer in m.moe_layers()]

    def step(self, found_inf=None) -> None:
        """The optimizer's step, then each MoE layer's balancing bias from the step's load;
        neither moves where `found_inf` (0-d float32, 1.0: a NaN or an Inf in the step) says
        so, decided on the device (playground/faults.py, `LaggedCheck`)."""
        self.optimizer.step(found_inf)
        for layer in self.moe_layers:
            layer.update_bias(found_inf)

    def local_grads(self) -> list:
        """[(name, tensor)]: the gradients this rank holds now (the optimizer's)."""
        return self.optimizer.local_grads()

    def skip_step(self) -> None:
        """No update this step (a NaN or an Inf found in it): gradients dropped, the MoE
        layers' load of the step forgotten, the balancing biases unmoved."""
        self.optimizer.skip_step()
        for layer in self.moe_layers:
            layer.load = None

    def buffers(self) -> list:
        """[(Placement, tensor)]: the optimizer-free state this rank holds, the MoE layers'
        balancing biases (replicated on every rank holding the layer)."""
        return [(Placement(f"blocks.{layer.index}.mlp.expert_bias", tuple(layer.expert_bias.shape), ()),
                 layer.expert_bias) for layer in self.moe_layers if layer.expert_bias is not None]

    def pieces(self, what: str) -> list:
        """[(Placement, CPU float64 copy)] of the weights ("param") or the reduced gradients
        ("grad") this rank holds."""
        return self.optimizer.pieces(what)

    def state_tensors(self) -> dict:
        return self.optimizer.state_tensors()

    def state_pieces(self) -> list:
        """[(kind, Placement, tensor)] this rank holds: weights and optimizer moments, and the
        "buffer"s (`buffers`) (checkpoints)."""
        return self.optimizer.state_pieces() + [("buffer", pl, t) for pl, t in self.buffers()]

    def steps_taken(self) -> int:
        """AdamW's updates so far (fewer than the training steps where some were skipped)."""
        return self.optimizer.steps_taken()

    def load_state(self, fill, step: int) -> None:
        """Set every local weight, moment and buffer from `fill(kind, placement)`; `step`:
        AdamW's step count (its updates, `steps_taken`)."""
        self.optimizer.load_state(fill, step)
        with torch.no_grad():
            for pl, t in self.buffers():
                t.copy_(fill("buffer", pl))


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


def graph_moe_layers(parts, device) -> None:
    """Each MoE layer's one compiled region replayed as CUDA graphs sharing one memory pool
    (model/cuda_graphs.py; the layouts it holds for: playground/run_config.py,
    `cuda_graphs_problem`), where the layer runs as that region: bf16 grouped GEMMs on a GPU
    of compute capability 9.0 or more."""
    layers = [layer for part in parts for layer in part.moe_layers()]
    if not str(device).startswith("cuda") or not grouped_mm_applies(
            torch.empty(0, device=device, dtype=torch.bfloat16), layers[0].experts.w_gate):
        where = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else device
        raise ValueError(f"--cuda-graphs replays the MoE layer's one compiled region, which runs on a GPU of compute "
                         f"capability 9.0 or more (bf16 grouped GEMMs): not on {where}")
    graphs = CudaGraphs()
    for layer in layers:
        layer.use_cuda_graphs(graphs)


def parallelize(model, mesh, run, device, state_dict=None) -> ParallelModel:
    """Apply `run.layout` to `model` (the reference GPT on the meta device) on this rank of
    `mesh`; `state_dict` (the reference GPT's) gives the initial weights instead of (seed,
    name). Nothing here is told how the rank is measured: strategies report to the rank's
    instruments through their groups, and the simulator prices the arithmetic through the
    rank's dispatch modes (model/regions.py)."""
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
    experts = parallelize_moe(parts, mesh, layout) if cfg.n_experts else None
    # 5. activation checkpointing, 6. compile
    if layout.ac != "none":
        for part in parts:
            checkpoint_blocks(part, layout.ac)
    if run.compile:
        for part in parts:
            compile_blocks(part)
    for part in parts:
        part.materialize(device, run.seed, state_dict, rank=mesh.rank)
    if run.cuda_graphs:
        graph_moe_layers(parts, device)
    # 7. data parallelism on each part: the dense parameters over dp × cp (under hybrid
    # sharding, sharded within dp_shard × cp and replicated across dp_replicate), and the
    # groups the transforms handed over (the experts' shards: moe/plan.py)
    shard, replicate = ((mesh.group("dp_shard", "cp"), mesh.group("dp_replicate")) if layout.dp_replicate > 1
                        else (dp, None))
    groups = [[ParamGroup(shard, replicate=replicate)] + (experts.param_groups(part) if experts else [])
              for part in parts]
    syncs, optimizer, autocast, hidden_dtype = data_parallel(parts, stages, groups, run, device, model_groups(mesh))
    if layout.pp > 1:
        pp = mesh.group("pp")
        split = layout.tp if layout.sequence_parallel else 1  # SP: stages pass the rank's slice of the sequence
        # (tokens are already this cp rank's share of the sequence)

        def hidden_shape(tokens):
            return tokens.shape[0], tokens.shape[1] // split, cfg.d_model
        def schedule(m):
            return build_schedule(layout.schedule, layout.pp, m, layout.virtual_stages)
        executor = PipelineExecutor(parts, pp, schedule(layout.microbatches), hidden_shape=hidden_shape,
                                    virtual_stages=layout.virtual_stages, syncs=syncs,
                                    hidden_dtype=hidden_dtype, schedule=schedule)
        runner = PipelineRunner(executor, pp, autocast)
    else:
        runner = GradientAccumulation(parts[0], syncs[0], autocast)
    return ParallelModel(parts, syncs, runner, optimizer, parts[0].positions,
                         [experts.aux] if experts else [])
