"""ZeRO-1/2/3 data parallelism with a sharded AdamW (Rajbhandari et al. 2019, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models"), parameters sharded in
FSDP-style units (Zhao et al. 2023, "PyTorch FSDP").

The model's parameters are grouped into units, each flattened into one buffer split into
equal shards over the data-parallel group (`FlatUnit`). The caller names the units, as
FSDP2's `fully_shard` is applied per module: submodules, in the order forward runs them
(training gives the embedding, each transformer block and the head: playground.data_parallel's
`zero_units`); the parameters left over form the root unit (there, the final norm). By
stage:

- 0: the baseline the paper compares with: gradients all-reduced, every rank holds and
  updates everything (mixed-precision data parallelism).
- 1 (P_os): each rank keeps the optimizer states (and the fp32 master weights) of its
  shard only. Full gradients accumulate locally; at the last microbatch each unit's
  gradient is reduce-scattered (in place, as soon as the unit's backward is done); each
  rank updates its shard, then each unit's parameters are all-gathered.
- 2 (P_os+g): gradients sharded too: each unit's gradient is reduce-scattered as soon as
  its backward is done, on every microbatch, into the rank's gradient shard, and the full
  unit gradient is freed.
- 3 (P_os+g+p): parameters sharded too: a unit's parameters are all-gathered before its
  forward and freed after it, all-gathered again before its backward (triggered by a
  hook on the unit's output gradient) and freed when its last parameter gradient has
  been accumulated; the next unit's all-gather is started ahead (prefetch) on the
  communication stream. The root unit is gathered from the start to the end of forward,
  and again from the start to the end of backward.

Mixed precision: parameters and gradients in `compute_dtype` (the model runs in it; see below), the
master weights and AdamW's states in the dtype the model was built in (fp32); gradients
accumulate in `grad_dtype` (default the compute dtype; float32: Megatron-LM's main grads,
`--accumulate-allreduce-grads-in-fp32`, which it requires for bf16, and DeepSpeed's bf16
optimizer: a microbatch's compute-dtype gradient added into a float32 buffer, so that a sum
over many microbatches is not rounded to 8 bits at each add) and are reduced in
`reduce_dtype` (default the gradients' dtype); fp16 gets dynamic loss
scaling (`loss_scaler.py`). At stage 3 no compute-dtype copy of a shard is kept: each
all-gather casts the master shard into its input (as FSDP2 does; the paper's 16Ψ/N
becomes 14Ψ/N). The gradient shards of stages 2-3 are made by the step's first reduction
and freed by the optimizer step (FSDP2's after `zero_grad(set_to_none=True)`), so they
do not exist through the next forward; the memory tracker counts them as the step's
gradients (`MemoryTracker.gradients`). The optimizer is torch's AdamW applied to the shards: AdamW
is elementwise, so updating shards equals updating the whole. With compute copies (mixed
precision, no loss scaling) at stages 0-2 its step is one pass a unit (`master_adamw`: the
compute-dtype gradient read, the copy written, AdamW in float32 within float rounding of its
formula; not bit for bit torch's kernel); stage 3, which keeps no copy, and fp16 keep
torch's step (stage 3's then matches FSDP2's bit for bit).

Hybrid sharding (HSDP; FSDP's HYBRID_SHARD, torchtitan's `dp_replicate × dp_shard`; Zhao et
al. 2023, section 3.2.1): with a `replicate` group the engine shards over `group` (the shard
group, within a node) and keeps one copy of its shards per replica: each unit's gradient is
reduce-scattered in the shard group, then its shard all-reduced across the replicas (both
averaging, so the result is the mean over shard × replicate ranks), and the parameters are
all-gathered within the shard group only. The replicas then hold equal shards, update them
alike, and the optimizer states are sharded by the shard group's size alone. The all-reduce
of a unit's shard is started when its reduce-scatter is done and waited before the shard is
used (as a unit's reduce-scatter is), so it overlaps the backward of the units before it.

Communication labels: `zero.grads.unit<i>` (all-reduce at stage 0, reduce-scatter
otherwise), `zero.replicate.unit<i>` (HSDP's all-reduce of the shard across replicas), `zero.params.unit<i>` (the all-gather after the step, stages 1-2),
`zero.gather.unit<i>` (stage 3's all-gathers), `zero.overflow` (fp16). Unit 0 is the root.

`overlap=False` (stages 0-1): every unit's gradient is reduced after the backward, in
the order the units finished, instead of as each is ready (Megatron-LM's data parallelism
of Narayanan et al. 2021 all-reduced its gradient buffer after the pipeline's
forward-backward; `RunConfig.grad_overlap`).

`finish_at_step=True` (under a pipeline): the end of the syncing backward starts what it
must and waits for nothing; `finish_grad_sync()` waits, once the pipeline's schedule is done
(Megatron-LM's `finish_grad_sync`, Narayanan et al. 2021), so a stage sends its input
gradient on without first waiting for its own reduction. Without overlap the reductions
then start there too: after the pipeline's forward-backward, as Megatron-LM's of 2021.

Under `no_sync()` stages 0 and 1 accumulate gradients locally and reduce at the next
backward outside it; stages 2 and 3 reduce every microbatch (their point is not to hold
a full gradient), so gradient accumulation costs them one gradient reduction per
microbatch, and stage 3 also two all-gathers per microbatch. Under a pipeline, whose
stages run many microbatches' forwards and backwards interleaved, `accumulate=True` takes
torchtitan's policy instead: stages 2-3 accumulate full gradients too and reduce once per
step, and stage 3 gathers each unit at its first use and keeps it until the optimizer
step. The step's traffic is then ZeRO-1's; what stages 2-3 still save is memory between
steps (no full gradient, and at stage 3 no gathered parameters, outside the step). When a unit's gradient is
ready comes from the machinery DDP uses too (model.grad_hooks).

Every shard knows its place in the reference (model.placement): the parameter's own
placement (whole, or a tensor-parallel slice) cut once more by the shard's flat range.
"""
from __future__ import annotations

import torch
from torch import nn

from collectives import ReduceOp
from model.regions import optimizer_kernel
from model.grad_hooks import GradientReady
from .master_adamw import master_adamw
from .optimizer import adamw, step_count, step_unless
from model.placement import placement_of

from .flat_unit import FlatUnit
from .loss_scaler import DynamicLossScaler


def unit_specs(module: nn.Module, units=(), exclude=()) -> list:
    """[(name, submodule or None, [(Placement, param)])]: the root unit `unit0` (the
    parameters outside every listed submodule; absent when there are none, as in a middle
    pipeline stage), then `unit<k+1>` for the k-th of `units` that has parameters; the
    parameters in `exclude` (another engine's) are left out."""
    placed = {id(p): placement_of(n, p) for n, p in module.named_parameters()}
    skip = {id(p) for p in exclude}
    in_units = {id(p) for u in units for p in u.parameters()}
    root = [(placed[id(p)], p) for p in module.parameters() if id(p) not in in_units and id(p) not in skip]
    specs = [("unit0", None, root)] if root else []
    for k, u in enumerate(units):
        mine = [(placed[id(p)], p) for p in u.parameters() if id(p) not in skip]
        if mine:
            specs.append((f"unit{k + 1}", u, mine))
    return specs


class ZeroDataParallel(nn.Module):
    def __init__(self, module: nn.Module, group, stage: int, units=(), exclude=(), grad_scale: float = 1.0,
                 lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, compute_dtype=None, reduce_dtype=None, grad_dtype=None,
                 loss_scaler: DynamicLossScaler | None = None, label: str = "zero",
                 overlap: bool = True, replicate=None, accumulate: bool = False, finish_at_step: bool = False,
                 fused_master_step: bool = True):
        super().__init__()
        # fp16, an engine stepped alone: the ranks that agree on its overflow (under a layout
        # the optimizer decides for all the rank's engines, over every rank of the model:
        # playground/data_parallel.py, ShardedOptimizer)
        self.overflow_groups = [group]
        self.finish_at_step = finish_at_step  # the reductions are waited by finish_grad_sync
        self.fused_master_step = fused_master_step  # compute copies at stages 0-2: AdamW in one pass (`step`)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if not overlap and stage >= 2:
            raise ValueError(f"ZeRO stage {stage} reduces each unit's gradient as its backward ends (it does not "
                             f"hold a full gradient): reducing after the backward needs stage 0 or 1")
        self.overlap = overlap  # False: reduce every unit's gradient after the backward, not as each is ready
        # under a pipeline (torchtitan's policy): stages 2-3 honour no_sync, accumulating full
        # gradients over the step's microbatches and reducing once, and stage 3 keeps each unit
        # gathered from its first use to the optimizer step instead of resharding per microbatch
        self.accumulate = accumulate
        self.module, self.group, self.stage, self.label = module, group, stage, label
        if replicate is not None and stage == 0:
            raise ValueError("hybrid sharding replicates shards: it needs ZeRO stage 1, 2 or 3 (stage 0 shards nothing)")
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        specs = unit_specs(module, units, exclude)
        # the dtype of this engine's own parameters: another engine of the same module (expert
        # parallelism's) may have turned its parameters into compute copies already
        self.master_dtype = next((p for _, _, placed in specs for _, p in placed), next(module.parameters())).dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        self.mixed = self.compute_dtype != self.master_dtype
        self.grad_dtype = grad_dtype or self.compute_dtype  # the flat gradient buffers' dtype
        if self.grad_dtype != self.compute_dtype and not self.mixed:
            raise ValueError(f"grad_dtype={self.grad_dtype}: gradients accumulate in another dtype than the compute "
                             f"dtype only beside compute copies (the model computes in {self.compute_dtype})")
        self.reduce_dtype = reduce_dtype or self.grad_dtype
        if loss_scaler is None and self.compute_dtype == torch.float16:
            loss_scaler = DynamicLossScaler()
        self.scaler = loss_scaler
        self.grad_scale = grad_scale  # multiplies the averaged gradients (expert parallelism's divisor)
        n, r = (1, 0) if stage == 0 else (group.size, group.rank)
        if self.mixed:  # the model computes in the compute dtype: its floating buffers too (RoPE tables),
            # but for state a module keeps in float32 (`float32_buffers`: the MoE balancing bias)
            for m in module.modules():
                for name, b in m.named_buffers(recurse=False):
                    if b.is_floating_point() and name not in getattr(m, "float32_buffers", ()):
                        b.data = b.data.to(self.compute_dtype)
        self.units = [FlatUnit(i, name, params, n, r, self.compute_dtype) for i, (name, _, params) in enumerate(specs)]
        self._modules_of = {u: m for u, (_, m, _) in zip(self.units, specs)}
        self._where = {}
        for u in self.units:
            for i, p in enumerate(u.params):
                self._where[p] = (u, i)
            full_master = u.initial if self.mixed else u.flat  # master dtype, full
            if stage == 3:
                # mixed precision: no compute copy of the shard is kept; each all-gather casts
                # the master shard into its input (as FSDP2 does)
                u.master = u.initial[u.lo:u.hi].clone() if self.mixed else u.flat[u.lo:u.hi].clone()
                u.param_shard = None if self.mixed else u.master
                u.free()
            else:
                u.param_shard = None
                u.master = full_master[u.lo:u.hi].clone() if self.mixed else u.flat[u.lo:u.hi]
            del u.initial
            u.grad_flat = torch.zeros(u.padded, dtype=self.grad_dtype, device=u.flat.device) if stage < 2 else None
            u.grad_written = set()  # the parameters whose part of grad_flat holds this step's gradient
            u.grad_shard = None  # stages 2-3: made by the step's first reduction, freed by the optimizer step
            u.reduce = None  # (work, buffer) of the gradient reduction in flight
        self.optimizer = adamw([u.master for u in self.units], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._in_flight: list = []  # units whose gradient reduction is in flight, oldest first
        self._replicating: list = []  # HSDP: units whose shard's all-reduce across replicas is in flight
        self._deferred: list = []  # without overlap: units whose gradients wait for the end of backward
        self.ready = GradientReady(self.units, lambda u: u.params, on_ready=self._unit_ready,
                                   on_end=self._end_of_backward, on_grad=self._grad_arrived)
        if stage == 3:
            self._install_stage3_hooks()

    # -- the training-loop interface --------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        """Stages 0-1: accumulate gradients locally; the next backward outside reduces them."""
        return self.ready.no_sync()

    def scale_loss(self, loss):
        """The loss to call backward on (multiplied by the loss scale with fp16)."""
        return loss * self.scaler.scale if self.scaler else loss

    def _local_grad(self, u) -> torch.Tensor:
        """The reduced gradient this rank updates with (its shard; all of it at stage 0)."""
        if self.stage == 0:
            g = u.grad_flat
        elif self.stage == 1:
            g = u.grad_flat[u.lo:u.hi]
        else:
            g = u.grad_shard if u.grad_shard is not None else torch.zeros(u.shard, dtype=self.grad_dtype,
                                                                            device=u.flat.device)
        return g * self.grad_scale if self.grad_scale != 1.0 else g

    @torch.no_grad()
    def step(self, found_inf=None, overflow: bool | None = None) -> bool:
        """AdamW on the shards, then publish the parameters; False if the step was skipped
        (fp16 overflow, or `found_inf` read on the host). `found_inf` (0-d float32, 1.0: a
        gradient somewhere was not finite) skips the update on the device where it can (the
        one pass, torch's fused kernel): the parameters are published unchanged. fp16:
        `overflow` is the decision of the optimizer that holds this engine beside others
        sharing its scaler (it moves the scaler after all of them stepped at its scale); None:
        the engine decides over its own gradients and moves its scaler itself."""
        grads = [self._local_grad(u) for u in self.units]
        if self.scaler:
            scale = self.scaler.scale
            if overflow is None:
                overflow = self.scaler.found_overflow(grads, self.overflow_groups, label=f"{self.label}.overflow")
                self.scaler.update(overflow)
            if overflow:
                self._zero_grads()
                return False
        one_pass = self.fused_master_step and self.mixed and not self.scaler and self.stage < 3
        if one_pass:  # AdamW from the compute-dtype gradients, writing the compute copies (master_adamw.py)
            master_adamw(self.optimizer, grads, [u.flat[u.lo:u.hi] for u in self.units], found_inf)
        else:
            for u, g in zip(self.units, grads):
                g = g.to(self.master_dtype) if g.dtype != self.master_dtype else g
                u.master.grad = g / scale if self.scaler else g
            with optimizer_kernel(self.optimizer):
                stepped = step_unless(self.optimizer, found_inf)
            for u in self.units:
                u.master.grad = None
            if not stepped:
                self._zero_grads()
                return False
        self._zero_grads()
        works = []
        for u in self.units:
            if self.stage == 3:  # the next all-gathers read the masters (kept gathered through a
                self._free(u)  # pipeline's step, each unit is resharded now)
                continue
            if self.mixed and not one_pass:
                u.flat[u.lo:u.hi].copy_(u.master)
            if self.stage > 0:
                works.append(self.group.all_gather(u.flat, u.flat[u.lo:u.hi], async_op=True,
                                                   label=f"{self.label}.params.{u.name}"))
        for w in works:
            w.wait()
        return True

    def local_grads(self) -> list:
        """[(name, tensor)]: the gradients this rank holds now (each unit's full flat gradient at
        stages 0-1, its shard at 2-3), in forward order; the tensors themselves, not copies."""
        out = []
        for u in self.units:
            g = u.grad_flat[u.lo:u.hi] if self.stage < 2 and u.grad_flat is not None else u.grad_shard
            if g is not None:
                out.append((f"{self.label} unit {u.name}", g))
        return out

    def skip_step(self) -> None:
        """Drop this step's gradients without updating (a step found non-finite)."""
        self._zero_grads()

    def _zero_grads(self) -> None:
        """Stages 0-1 zero their full gradients; stages 2-3 free their shards (FSDP2's grads
        after zero_grad(set_to_none=True)): they do not exist through the next forward."""
        for u in self.units:
            u.grad_written.clear()
            if self.stage < 2:  # (the next backward copies each gradient in, or zeros it: _unit_ready)
                continue
            if u.grad_flat is not None:  # (a step skipped mid-accumulation: its full gradient goes too)
                self._buffer(-u.grad_flat.nbytes)
                u.grad_flat = None
            if u.grad_shard is not None:
                self._step_gradients(-u.grad_shard.nbytes)
                u.grad_shard = None

    # -- gradients ------------------------------------------------------------------------------
    def _buffer(self, nbytes: int, made=None) -> None:
        """Count nbytes (< 0: free them) as communication buffers; `made`: the tensor, made in
        backward, that the memory tracker must then not count as a temporary too. The tracker
        is the rank's, as its groups give it (`group.instruments`: collectives/instruments.py)."""
        memory = self.group.instruments.memory
        if memory is not None:
            if made is not None:
                memory.claim(made)
            memory.buffer(nbytes)

    def _step_gradients(self, nbytes: int, made=None) -> None:
        """Count nbytes (< 0: free them) as gradients that live until the optimizer step
        (stages 2-3's shards); `made`: as in `_buffer`."""
        memory = self.group.instruments.memory
        if memory is not None:
            if made is not None:
                memory.claim(made)
            memory.gradients(nbytes)

    def _grad_arrived(self, p) -> None:
        """Move p's gradient into its unit's flat gradient buffer: copied into its part the
        first time in a step (the part is not zeroed beforehand: 4 bytes an element moved
        instead of the 8 of zeroing and adding), added to it after."""
        u, i = self._where[p]
        self._ensure_grad_flat(u)
        view = u.view_of(u.grad_flat, i)
        if i in u.grad_written:
            view.add_(p.grad)
        else:
            view.copy_(p.grad)
            u.grad_written.add(i)
        p.grad = None

    def _ensure_grad_flat(self, u) -> None:
        if u.grad_flat is None:  # (stages 2-3) its parts are written by _grad_arrived or _unit_ready
            u.grad_flat = torch.empty(u.padded, dtype=self.grad_dtype, device=u.flat.device)
            u.grad_flat[u.numel:].zero_()  # the padding (flat_unit.py)
            u.grad_written.clear()
            self._buffer(u.grad_flat.nbytes, made=u.grad_flat)

    def _unit_ready(self, u, pending: list) -> None:
        """Every gradient of unit `u` is in (`pending`, at the end of backward: those that
        got none, which contribute zeros: their parts no gradient was written into this step
        are zeroed before the reduction reads them)."""
        if pending and self._reducing():
            self._ensure_grad_flat(u)
            for p in pending:
                _, i = self._where[p]
                if i not in u.grad_written:
                    u.view_of(u.grad_flat, i).zero_()
                    u.grad_written.add(i)
        self._unit_backward_done(u)

    def _reducing(self) -> bool:
        return (self.stage >= 2 and not self.accumulate) or self.ready.require_sync

    def _unit_backward_done(self, u) -> None:
        if self.stage == 3 and not self.accumulate:
            self._free(u)
        if not self._reducing():
            return
        if not self.overlap:
            self._deferred.append(u)
            return
        self._reduce(u)

    def _reduce(self, u) -> None:
        """Start the reduction of unit `u`'s gradient."""
        buf = u.grad_flat if self.reduce_dtype == self.grad_dtype else u.grad_flat.to(self.reduce_dtype)
        if buf is not u.grad_flat:  # (the copy in the reduction's dtype lives until its result is collected)
            self._buffer(buf.nbytes, made=buf)
        label = f"{self.label}.grads.{u.name}"
        if self.stage == 0:
            work = self.group.all_reduce(buf, op=ReduceOp.AVG, async_op=True, label=label)
        else:
            work = self.group.reduce_scatter(buf[u.lo:u.hi], buf, op=ReduceOp.AVG, async_op=True, label=label)
        u.reduce = (work, buf)
        self._in_flight.append(u)
        # Stages 2-3 hold a unit's full gradient only while it is reduced: with one more
        # reduction in flight, the older one is finished and its buffer freed (otherwise
        # every unit's full gradient would be alive at the end of backward: 2Ψ).
        while self.stage >= 2 and len(self._in_flight) > 1:
            self._finish_reduce(self._in_flight.pop(0))

    def _finish_reduce(self, u) -> None:
        work, buf = u.reduce
        work.wait()
        if self.replicate is not None:  # HSDP: the shard, averaged across the replicas next
            work = self.replicate.all_reduce(buf[u.lo:u.hi], op=ReduceOp.AVG, async_op=True,
                                             label=f"{self.label}.replicate.{u.name}")
            u.reduce = (work, buf)
            self._replicating.append(u)
            while self.stage >= 2 and len(self._replicating) > 1:  # (one unit's full gradient in flight)
                self._finish_replicate(self._replicating.pop(0))
            return
        self._collect(u, buf)

    def _finish_replicate(self, u) -> None:
        work, buf = u.reduce
        work.wait()
        self._collect(u, buf)

    def _collect(self, u, buf) -> None:
        """Keep unit `u`'s reduced gradient from `buf` (its shard, at stages 1-3)."""
        cast = buf is not u.grad_flat  # (the copy in the reduction's dtype: let go of at the end)
        if self.stage >= 2:
            if u.grad_shard is None:
                u.grad_shard = buf[u.lo:u.hi].to(self.grad_dtype, copy=True)
                self._step_gradients(u.grad_shard.nbytes, made=u.grad_shard)
            else:
                u.grad_shard.add_(buf[u.lo:u.hi])
            self._buffer(-u.grad_flat.nbytes)
            u.grad_flat = None
        elif buf is not u.grad_flat:
            part = slice(None) if self.stage == 0 else slice(u.lo, u.hi)
            u.grad_flat[part].copy_(buf[part])
        u.reduce = None
        if cast:
            self._buffer(-buf.nbytes)

    def _end_of_backward(self) -> None:
        if not self.finish_at_step:
            self.finish_grad_sync()

    def finish_grad_sync(self) -> None:
        """Start the reductions left for the end (without overlap) and wait for every one in
        flight; at stage 3 outside a pipeline, free the gathered units."""
        for u in self._deferred:
            self._reduce(u)
        self._deferred = []
        for u in self._in_flight:
            self._finish_reduce(u)
        self._in_flight = []
        for u in self._replicating:
            self._finish_replicate(u)
        self._replicating = []
        if self.stage == 3 and not self.accumulate:
            for u in self.units:
                self._free(u)

    # -- stage 3: parameters gathered around their use -----------------------------------------
    def _gather(self, u, wait: bool) -> None:
        # the shard in the compute dtype: the master itself, or (mixed precision: no
        # param_shard) its cast, a buffer held by the unit until the all-gather is done
        cast = u.param_shard is None
        if not u.gathered and u.gather_work is None:
            shard = u.master.to(self.compute_dtype) if cast else u.param_shard
            u.gather(self.group, shard, label=f"{self.label}.gather.{u.name}")
            self._buffer(u.nbytes + (shard.nbytes if cast else 0), made=shard if cast else None)
        if wait and u.gather_work is not None:
            nbytes = u.gather_input.nbytes if cast else 0
            u.wait_gathered()
            self._buffer(-nbytes)

    def _free(self, u) -> None:
        if u.gathered:
            u.free()
            self._buffer(-u.nbytes)

    def _install_stage3_hooks(self) -> None:
        blocks = [u for u in self.units if self._modules_of[u] is not None]
        root = self.units[0] if self._modules_of[self.units[0]] is None else None
        # The root unit (the parameters outside every named unit) is gathered around the whole forward
        # and again for the whole backward, so every parameter is gathered twice per step
        # (the paper's 3Ψ; FSDP keeps its root gathered instead, saving Ψ_root of traffic).
        if root is not None:
            self.module.register_forward_pre_hook(self._pre_forward_hook(root, blocks[0] if blocks else None))
            self.module.register_forward_hook(self._post_forward_hook(root, blocks[-1] if blocks else None))
        for k, u in enumerate(blocks):
            m = self._modules_of[u]
            nxt = blocks[k + 1] if k + 1 < len(blocks) else None
            prev = blocks[k - 1] if k > 0 else None
            m.register_forward_pre_hook(self._pre_forward_hook(u, nxt))
            m.register_forward_hook(self._post_forward_hook(u, prev))
            # a unit inside a checkpointed block (experts) runs its forward again in backward:
            # activation checkpointing sets this while it does
            m.recomputing = False

    def _pre_forward_hook(self, u, nxt):
        def hook(module, args):
            self._gather(u, wait=True)
            if nxt is not None and not getattr(module, "recomputing", False):
                self._gather(nxt, wait=False)  # prefetch
        return hook

    def _post_forward_hook(self, u, prev):
        def pre_backward(grad):
            self._gather(u, wait=True)
            if prev is not None:
                self._gather(prev, wait=False)  # prefetch, backward runs the blocks in reverse
            return None

        def hook(module, args, output):
            if getattr(module, "recomputing", False):  # its backward is next: keep it gathered until
                return  # its gradients are accumulated (the unit's own backward frees it)
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(pre_backward)
            if not self.accumulate:
                self._free(u)
        return hook

    # -- Contract 4 and memory ----------------------------------------------------------------
    def pieces(self, what: str = "param") -> list:
        """[(Placement, CPU float64 copy)] of this rank's master weights (`what`="param") or
        reduced gradients ("grad"): each parameter part its shard holds."""
        out = []
        for u in self.units:
            src = u.master if what == "param" else self._local_grad(u)
            src = src.detach().to("cpu", torch.float64)
            if what == "grad" and self.scaler:
                src = src / self.scaler.scale
            for pl, loc in u.owned():
                n = pl.local_shape[0]
                out.append((pl, src[loc:loc + n].clone()))
        return out

    def state_pieces(self) -> list:
        """[(kind, Placement, tensor)] of everything a checkpoint keeps of this engine: the
        master weights ("param") and AdamW's moments ("exp_avg", "exp_avg_sq") of every
        parameter part in this rank's shard (views, not copies)."""
        out = []
        for u in self.units:
            state = self.optimizer.state.get(u.master, {})
            for pl, loc in u.owned():
                n = pl.local_shape[0]
                out.append(("param", pl, u.master[loc:loc + n]))
                for kind in ("exp_avg", "exp_avg_sq"):
                    if kind in state:
                        out.append((kind, pl, state[kind][loc:loc + n]))
        return out

    @torch.no_grad()
    def load_state(self, fill, step: int) -> None:
        """Set the shards from a checkpoint: `fill(kind, placement)` gives the values of a
        piece; `step` is AdamW's step count. The compute copies follow the master weights."""
        for u in self.units:
            state = self.optimizer.state[u.master]
            if step:
                state["step"] = step_count(self.optimizer, u.master, step)
                for kind in ("exp_avg", "exp_avg_sq"):
                    state.setdefault(kind, torch.zeros_like(u.master, memory_format=torch.preserve_format))
            for pl, loc in u.owned():
                n = pl.local_shape[0]
                u.master[loc:loc + n].copy_(fill("param", pl))
                if step:
                    for kind in ("exp_avg", "exp_avg_sq"):
                        state[kind][loc:loc + n].copy_(fill(kind, pl))
            if self.stage < 3:  # (stage 3 gathers from the masters)
                # the whole compute copy, from the checkpoint (no collective needed)
                for i, pl in enumerate(u.placements):
                    u.view_of(u.flat, i).copy_(fill("param", pl))

    def state_tensors(self) -> dict:
        """The tensors this rank holds now, by category: parameters (compute copies: full
        flat buffers at stages 0-2, the rank's shard at stage 3, plus any unit gathered
        now), gradients (full at stages 0-1, the shard at 2-3) and optimizer states
        (AdamW's, and the master weights where they are a separate copy: mixed precision)."""
        params = [u.flat for u in self.units if u.gathered] + [u.param_shard for u in self.units
                                                                if u.param_shard is not None]
        grads = [u.grad_flat if self.stage < 2 else u.grad_shard for u in self.units]
        states = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        masters = [u.master for u in self.units] if self.mixed else []
        return {"parameters": params, "gradients": grads, "optimizer": states + masters}
