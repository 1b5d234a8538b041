"""Data parallelism, the last transform of `parallelize` (docs/architecture.md, "Composition",
step 7), as one function over the parameter groups the earlier transforms hand it.

Each `ParamGroup` names parameters of a model part and the group their gradients are
averaged over: the dense parameters over dp × cp (cp ranks hold the same parameters and see
other tokens of the same sequences, as in Megatron and torchtitan), the expert shards over
their expert-data-parallel group with a gradient scale. One engine serves every group of a
run, by what it shards:

- nothing (DDP; Li et al. 2020, "PyTorch Distributed"): `ddp.DistributedDataParallel`, its
  gradients all-reduced in buckets, and AdamW on every local parameter (`ReplicatedAdamW`);
  a group of one rank gets no wrapper (nothing to average) unless it scales its gradients;
- optimizer states, gradients or parameters (ZeRO-1/2/3; Rajbhandari et al. 2019):
  `zero.ZeroDataParallel` over the group, sharding by stage, its units the part's
  embedding, blocks and head (`zero_units`); and with a `replicate` group, hybrid sharding
  (HSDP; Zhao et al. 2023): the shards replicated across it, each reduced shard averaged
  over the replicas. Under a pipeline the engine takes torchtitan's policy (`accumulate`).

The optimizer of the run follows (`ReplicatedAdamW`, or `ShardedOptimizer` over the
engines), and so do the compute dtype and autocast: ZeRO computes in its compute copies,
DDP in the weights' dtype under bf16 autocast.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from model.regions import optimizer_kernel
from ddp import DistributedDataParallel
from model import placement_of
from zero.optimizer import adamw, step_count, step_unless, steps_taken
from simulator.memory import storage_bytes
from zero import DynamicLossScaler, ZeroDataParallel

from .run_config import torch_dtype


@dataclass
class ParamGroup:
    """Parameters of a part whose gradients are averaged over `group` (a transform's hand-off
    to data parallelism)."""
    group: object  # the ranks the gradients are averaged over; ZeRO shards over them
    params: list | None = None  # None: the part's parameters that no other group of it names
    replicate: object = None  # hybrid sharding: the shards' replicas, averaged across
    scale: float = 1.0  # multiplies the averaged gradients (expert parallelism's divisor)
    units: list | None = None  # ZeRO's units, in forward order (None: `zero_units` of the part)
    name: str = ""  # the ledger label's suffix: zero.<name>, ddp.<name>


def uses_zero(run) -> bool:
    """The ZeRO engine (at stage 0 too: fp16 loss scaling, bf16 compute copies) or DDP."""
    return run.dtype in ("bfloat16", "float16") and not run.autocast or bool(run.layout.zero)


def data_parallel(parts, stages, groups, run, device, everyone=None) -> tuple:
    """Wrap each part's parameter groups (`groups[i]`: the ParamGroups of `parts[i]`, whose
    pipeline stage is `stages[i]`); returns (syncs, optimizer, autocast, hidden_dtype): each
    part's wrappers together (`Syncs`), the run's optimizer, the autocast context of its
    forward, and the dtype of the activations between pipeline stages. `everyone`: groups
    spanning every rank of the model, over which fp16's overflow is agreed."""
    layout = run.layout
    label = (lambda s, name: f"{name}.pp{s}") if layout.pp > 1 else (lambda s, name: name)
    zero = uses_zero(run)
    # fp16: one loss scaler for every engine of the rank (a pipeline's chunks, the experts'
    # beside the dense parameters), whose overflow the optimizer decides once for all of them
    scaler = DynamicLossScaler() if zero and run.dtype == "float16" else None
    bucket_mb = run.bucket_cap_mb if run.grad_overlap else float("inf")  # one bucket: reduced after backward
    wrappers = []
    for s, part, part_groups in zip(stages, parts, groups):
        named = [p for g in part_groups if g.params is not None for p in g.params]
        w = []
        for g in part_groups:
            params = g.params if g.params is not None else [p for p in part.parameters()
                                                             if all(p is not q for q in named)]
            others = [p for p in part.parameters() if all(p is not q for q in params)]
            kind = "zero" if zero else "ddp"
            name = label(s, f"{kind}.{g.name}" if g.name else kind)
            if zero:
                w.append(ZeroDataParallel(part, g.group, layout.zero, units=g.units or zero_units(part),
                                          exclude=others, grad_scale=g.scale, lr=run.lr, betas=run.betas,
                                          weight_decay=run.weight_decay, compute_dtype=torch_dtype(run.dtype),
                                          reduce_dtype=torch_dtype(run.reduce_dtype) if run.reduce_dtype else None,
                                          grad_dtype=torch_dtype(run.grad_dtype) if run.grad_dtype else None,
                                          label=name, overlap=run.grad_overlap,
                                          replicate=g.replicate, accumulate=layout.pp > 1,
                                          finish_at_step=layout.pp > 1, fused_master_step=run.fused_master_step,
                                          loss_scaler=scaler))
            elif g.group.size > 1 or g.scale != 1:  # (a group of one rank has nothing to average)
                w.append(DistributedDataParallel(part, g.group, bucket_cap_mb=bucket_mb, label=name, params=params,
                                                 grad_scale=g.scale, finish_at_step=layout.pp > 1))
        wrappers.append(w)
    if zero:
        optimizer = ShardedOptimizer([e for w in wrappers for e in w], everyone)
        autocast = contextlib.nullcontext()  # ZeRO computes in its compute copies' dtype
        hidden_dtype = torch_dtype(run.dtype) if run.dtype in ("bfloat16", "float16") else run.param_dtype
    else:
        optimizer = ReplicatedAdamW(parts, run, groups[0][0].group, buckets=any(wrappers))
        # autocast caches each weight's bf16 copy for the whole region (a pipeline's whole
        # schedule), so a block's first forward may cast fewer weights than its recomputation,
        # and selective checkpointing needs the same ops both times: no cache under checkpointing
        autocast = (torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16,
                                   cache_enabled=layout.ac == "none")
                    if run.dtype == "bfloat16" and device != "meta" else contextlib.nullcontext())
        hidden_dtype = run.param_dtype
    return [Syncs(w) for w in wrappers], optimizer, autocast, hidden_dtype


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

    def finish_grad_sync(self) -> None:
        """Wait for the reductions the step's syncing backwards left in flight (a pipeline's)."""
        for w in self.wrappers:
            w.finish_grad_sync()


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

    def step(self, found_inf=None) -> None:
        """AdamW's step (skipped where `found_inf`, 1.0, says a gradient was not finite), then
        the gradients dropped."""
        with optimizer_kernel(self.optimizer):
            step_unless(self.optimizer, found_inf)
        if not self.buckets:
            self.grad_bytes = storage_bytes(p.grad for m in self.parts for p in m.parameters())
        self.optimizer.zero_grad(set_to_none=not self.buckets)

    def local_grads(self) -> list:
        """[(name, gradient)] of every local parameter that has one, in the model's order."""
        return [(name, p.grad) for m in self.parts for name, p in m.named_parameters() if p.grad is not None]

    def skip_step(self) -> None:
        """Drop this step's gradients without updating (a step found non-finite)."""
        self.optimizer.zero_grad(set_to_none=not self.buckets)

    def steps_taken(self) -> int:
        """AdamW's updates so far (`zero.optimizer.steps_taken`)."""
        return steps_taken(self.optimizer)

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
    """ZeRO: each part's engine updates the shards it owns. fp16: the engines share one
    loss scaler (`data_parallel`), and the step's overflow is decided once, over every
    engine's gradients and every rank of the model (`everyone`), so that every engine of
    every rank skips the same steps and keeps the same scale: the scale a pipeline's last
    stage multiplied the loss by is the one each earlier stage divides by."""

    def __init__(self, engines: list, everyone=None):
        self.engines, self.everyone = engines, everyone
        scalers = {id(e.scaler): e.scaler for e in engines if e.scaler is not None}
        if len(scalers) > 1:
            raise ValueError(f"the engines of a rank hold {len(scalers)} loss scalers: they must share one")
        self.scaler = next(iter(scalers.values()), None)

    def step(self, found_inf=None) -> None:
        overflow = None
        if self.scaler is not None:
            grads = [g for e in self.engines for _, g in e.local_grads()]
            overflow = self.scaler.found_overflow(grads, self.everyone or [self.engines[0].group], label="zero.overflow",
                                                  device=self.engines[0].units[0].flat.device)
        for e in self.engines:
            e.step(found_inf, overflow)
        if overflow is not None:
            self.scaler.update(overflow)

    def pieces(self, what: str) -> list:
        return [x for e in self.engines for x in e.pieces(what)]

    def local_grads(self) -> list:
        return [x for e in self.engines for x in e.local_grads()]

    def skip_step(self) -> None:
        for e in self.engines:
            e.skip_step()

    def steps_taken(self) -> int:
        """AdamW's updates so far: every engine skips the same steps."""
        return max((steps_taken(e.optimizer) for e in self.engines), default=0)

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
        return [self.scaler] if self.scaler is not None else []



def zero_units(part) -> list:
    """The ZeRO units of a model part, in forward order: the embedding, each block and the
    head (those it holds); the final norm is left to the root unit. The embedding and the
    head are units of their own (as torchtitan shards them) so that ZeRO-3 gathers each
    around its own use only, and their gradients, made at the two ends of backward, are
    reduced apart: in one root unit both were gathered, and the head's gradient held in the
    root's buffer, from the start of backward to its end."""
    return [m for m in (part.tok_emb, *part.blocks.values(), part.lm_head) if m is not None]


def data_parallel_group(mesh, layout):
    """The group gradients are averaged over: dp × cp (context-parallel ranks hold the same
    parameters and see different tokens of the same sequences)."""
    return mesh.group("dp", "cp") if layout.cp > 1 else mesh.group("dp")


def model_groups(mesh) -> list:
    """Groups that together span every rank of the model: its data-, context- and
    tensor-parallel ranks, then its pipeline stages (those of more than one rank). Where all
    must decide alike (a NaN found, an fp16 overflow), a flag all-reduced over each in turn."""
    return [g for g in (mesh.group("dp", "cp", "tp"), mesh.group("pp")) if g.size > 1]
