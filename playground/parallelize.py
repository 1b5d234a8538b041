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
7. data parallelism on each part over dp × cp (parameters are replicated across cp, as in
   Megatron and torchtitan): DDP, or ZeRO with the part's blocks as units (under hybrid
   sharding, ZeRO within dp_shard × cp and its shards all-reduced across dp_replicate); with expert
   parallelism the expert shards get a wrapper of their own over the expert-data-parallel
   group, their averaged gradients divided by ep (moe/plan.py says why).

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
from collectives.timing import optimizer_kernel
from ddp import DistributedDataParallel
from model import placement_of
from model.gpt import CrossEntropy
from model.optimizer import adamw, step_count
from moe import expert_parameters, parallelize_experts
from pipeline import PipelineExecutor, build_schedule, split_stages
from sequence_parallel import parallelize_context, shard_sequence
from simulator.memory import storage_bytes
from tensor_parallel import parallelize_tensor
from zero import ZeroDataParallel

from model.moe import MoEStats

from .run_config import torch_dtype


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


class Syncs:
    """A part's data-parallel wrappers together (the dense one, and the experts' under
    expert parallelism): `no_sync` enters all of them."""

    def __init__(self, wrappers: list):
        self.wrappers = wrappers

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            for w in self.wrappers:
                stack.enter_context(w.no_sync())
            yield

    @contextlib.contextmanager
    def synced(self):
        """The backward that reduces the step's gradients. A wrapper none of whose parameters
        got a gradient in it ends it by hand (model.grad_hooks): in a pipeline's split backward
        the experts' wrapper has all its gradients from the I passes, and W syncs."""
        before = [w.ready.ended for w in self.wrappers]
        yield
        for w, n in zip(self.wrappers, before):
            if w.ready.ended == n:
                w.ready.end()

    def scale_loss(self, loss):
        return self.wrappers[0].scale_loss(loss) if self.wrappers else loss


# -- what the optimizer holds --------------------------------------------------------------------
class ReplicatedAdamW:
    """torch's AdamW on the local parameters (whole, or tensor-parallel slices) of every
    part; data parallelism keeps them equal across the replicas (DDP)."""

    def __init__(self, parts: list, run, group, buckets: bool = True):
        """`buckets`: the gradients are views into DDP's buckets (zeroed in place after each
        step); otherwise they are freed after each step, as torch's `zero_grad` does, so that
        they do not take memory while the next forward's activations peak."""
        self.parts, self.buckets, self.group = parts, buckets, group  # group: any of this rank's (its timing)
        self.grad_bytes = 0  # without buckets: what the gradients took at the last step
        self.optimizer = adamw([p for m in parts for p in m.parameters()], lr=run.lr, betas=run.betas,
                               weight_decay=run.weight_decay)

    def step(self) -> None:
        with optimizer_kernel(self.group, self.optimizer):
            self.optimizer.step()
        if not self.buckets:
            self.grad_bytes = storage_bytes(p.grad for m in self.parts for p in m.parameters())
        self.optimizer.zero_grad(set_to_none=not self.buckets)

    def pieces(self, what: str) -> list:
        out = []
        for m in self.parts:
            for name, p in m.named_parameters():
                t = p if what == "param" else p.grad
                if t is not None:
                    out.append((placement_of(name, p), t.detach().to("cpu", torch.float64).clone()))
        return out

    def state_tensors(self) -> dict:
        params = [p for m in self.parts for p in m.parameters()]
        states = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        grads = [p.grad for p in params] if self.buckets else self.grad_bytes
        return {"parameters": params, "gradients": grads, "optimizer": states}

    def state_pieces(self) -> list:
        """[(kind, Placement, tensor)]: the weights ("param") and AdamW's moments of every
        local parameter (a checkpoint's content)."""
        out = []
        for m in self.parts:
            for name, p in m.named_parameters():
                pl = placement_of(name, p)
                out.append(("param", pl, p.detach()))
                state = self.optimizer.state.get(p, {})
                out += [(kind, pl, state[kind]) for kind in ("exp_avg", "exp_avg_sq") if kind in state]
        return out

    @torch.no_grad()
    def load_state(self, fill, step: int) -> None:
        for m in self.parts:
            for name, p in m.named_parameters():
                pl = placement_of(name, p)
                p.copy_(fill("param", pl))
                if step:
                    state = self.optimizer.state[p]
                    state["step"] = step_count(self.optimizer, p, step)
                    for kind in ("exp_avg", "exp_avg_sq"):
                        state[kind] = fill(kind, pl).to(p.dtype).to(p.device).clone()


class ShardedOptimizer:
    """ZeRO: each part's engine updates the shards it owns."""

    def __init__(self, engines: list):
        self.engines = engines

    def step(self) -> None:
        for e in self.engines:
            e.step()

    def pieces(self, what: str) -> list:
        return [x for e in self.engines for x in e.pieces(what)]

    def state_tensors(self) -> dict:
        out = {"parameters": [], "gradients": [], "optimizer": []}
        for e in self.engines:
            for k, v in e.state_tensors().items():
                out[k] += v
        return out

    def state_pieces(self) -> list:
        return [x for e in self.engines for x in e.state_pieces()]

    def load_state(self, fill, step: int) -> None:
        for e in self.engines:
            e.load_state(fill, step)

    @property
    def scalers(self) -> list:
        return [e.scaler for e in self.engines if e.scaler is not None]


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


def zero_units(part) -> list:
    """The ZeRO units of a model part, in forward order: the embedding, each block and the
    head (those it holds); the final norm is left to the root unit. The embedding and the
    head are units of their own (as torchtitan shards them) so that ZeRO-3 gathers each
    around its own use only, and their gradients, made at the two ends of backward, are
    reduced apart: in one root unit both were gathered, and the head's gradient held in the
    root's buffer, from the start of backward to its end."""
    return [m for m in (part.tok_emb, *part.blocks.values(), part.lm_head) if m is not None]


def _uses_zero(run) -> bool:
    return bool(run.layout.zero) or run.dtype == "float16" or (run.dtype == "bfloat16" and run.bf16_copies)


def expert_mesh(mesh, layout):
    """The same ranks as `mesh`, with dp × cp seen as (edp, ep): expert-parallel groups of ep
    neighbouring dp × cp ranks, and the expert-data-parallel groups across them."""
    from collectives import Mesh
    return Mesh(mesh.parent, **expert_mesh_axes(layout))


def expert_mesh_axes(layout) -> dict:
    ep = max(1, layout.ep)
    return {"pp": layout.pp, "edp": layout.dp * layout.cp // ep, "ep": ep, "tp": layout.tp}


def data_parallel_group(mesh, layout):
    """The group gradients are averaged over: dp × cp (context-parallel ranks hold the same
    parameters and see different tokens of the same sequences)."""
    return mesh.group("dp", "cp") if layout.cp > 1 else mesh.group("dp")


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
    # 7. data parallelism on each part
    zero = _uses_zero(run)
    label = (lambda s, name: f"{name}.pp{s}") if layout.pp > 1 else (lambda s, name: name)
    experts = [expert_parameters(part) if split_experts else [] for part in parts]
    # expert shards: the sum over the expert-data-parallel group (× tp slices) over dp·cp (moe/plan.py)
    expert_scale = sp_slices / layout.ep
    if zero:
        def zero_engine(part, group, units, exclude, name, scale=1.0, replicate=None):
            return ZeroDataParallel(part, group, layout.zero, units=units, exclude=exclude, grad_scale=scale,
                                    lr=run.lr, betas=run.betas, weight_decay=run.weight_decay,
                                    compute_dtype=torch_dtype(run.dtype),
                                    reduce_dtype=torch_dtype(run.reduce_dtype) if run.reduce_dtype else None,
                                    memory=memory, label=name, overlap=run.grad_overlap, replicate=replicate,
                                    accumulate=layout.pp > 1)
        # hybrid sharding: the dense parameters sharded within dp_shard (× cp), the shards
        # replicated across dp_replicate (the experts keep theirs over the expert-data-parallel group)
        shard, replicate = ((mesh.group("dp_shard", "cp"), mesh.group("dp_replicate")) if layout.dp_replicate > 1
                            else (dp, None))
        wrappers = []
        for s, part, mine in zip(stages, parts, experts):
            w = [zero_engine(part, shard, zero_units(part), mine, label(s, "zero"), replicate=replicate)]
            if mine:
                dense = [p for p in part.parameters() if all(p is not q for q in mine)]
                w.append(zero_engine(part, edp_group, [m.experts for m in part.moe_layers()], dense,
                                     label(s, "zero.experts"), expert_scale))
            wrappers.append(w)
        optimizer = ShardedOptimizer([e for w in wrappers for e in w])
        autocast = contextlib.nullcontext()  # ZeRO computes in its compute copies' dtype
        hidden_dtype = torch_dtype(run.dtype) if run.dtype in ("bfloat16", "float16") else run.param_dtype
    else:
        bucket_mb = run.bucket_cap_mb if run.grad_overlap else float("inf")  # one bucket: reduced after backward
        # a replica group of one rank has nothing to average: no wrapper, no buckets (the
        # experts' wrapper stays where it scales their gradients)
        wrappers = []
        for s, part, mine in zip(stages, parts, experts):
            dense = [p for p in part.parameters() if all(p is not q for q in mine)]
            w = [DistributedDataParallel(part, dp, bucket_cap_mb=bucket_mb, label=label(s, "ddp"), params=dense)
                 ] if dp.size > 1 else []
            if mine and (edp_group.size > 1 or expert_scale != 1):
                w.append(DistributedDataParallel(part, edp_group, bucket_cap_mb=bucket_mb,
                                                 label=label(s, "ddp.experts"), params=mine,
                                                 grad_scale=expert_scale))
            wrappers.append(w)
        optimizer = ReplicatedAdamW(parts, run, dp, buckets=any(wrappers))
        # autocast caches each weight's bf16 copy for the whole region (a pipeline's whole
        # schedule), so a block's first forward may cast fewer weights than its recomputation,
        # and selective checkpointing needs the same ops both times: no cache under checkpointing
        autocast = (torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16,
                                   cache_enabled=layout.ac == "none")
                    if run.dtype == "bfloat16" and device != "meta" else contextlib.nullcontext())
        hidden_dtype = run.param_dtype
    syncs = [Syncs(w) for w in wrappers]
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
