"""Building the parallel model of a layout (DESIGN.md: the playground's job): one object
per strategy with the interface the training loop drives.

    forward(tokens, targets) -> loss      no_sync()        scale_loss(loss)
    step()                                pieces(what)     model_states()
    params (excluded from activations)    autocast

`DataParallel` is DDP with torch's AdamW (`--dtype bfloat16`: float32 weights under bf16
autocast); `TensorParallel` the Megatron-split GPT with DDP over dp; `Zero` is ZeRO stage
0-3 (`--dtype bfloat16|float16`: compute copies in that dtype, float32 master weights and
optimizer states; float16 with dynamic loss scaling); `Pipeline` runs a whole step of
microbatches by its schedule (`run_step` instead of forward/backward per microbatch).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from simulator.memory import MemoryTracker
from ddp import DistributedDataParallel
from model import GPT
from pipeline import PipelineExecutor, PipelineStage, build_schedule, partition
from tensor_parallel import ParallelGPT
from zero import ZeroDataParallel

from .run_config import DTYPES
from .shards import Piece, snapshot, whole_pieces


class DataParallel:
    def __init__(self, run, dp, device, memory=None, model=None):
        self.model = model or GPT(run.model, seed=run.seed, dtype=run.param_dtype, device=device)
        self.ddp = DistributedDataParallel(self.model, dp, bucket_cap_mb=run.bucket_cap_mb)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=run.lr, betas=run.betas,
                                           weight_decay=run.weight_decay)
        self.params = list(self.model.parameters())
        self._pieces = whole_pieces(self.model)
        self.autocast = (torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
                         if run.dtype == "bfloat16" else contextlib.nullcontext())

    def forward(self, tokens, targets):
        return self.ddp(tokens, targets)

    def no_sync(self):
        return self.ddp.no_sync()

    def scale_loss(self, loss):
        return loss

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # zero in place: the gradients stay views into the buckets

    def pieces(self, what: str) -> list:
        return snapshot(self.model, self._pieces, what)

    def model_states(self) -> dict:
        return MemoryTracker.model_states(self.model, self.optimizer)


class TensorParallel(DataParallel):
    """Megatron TP (with --sp, sequence parallelism) inside each DP replica; DDP over dp."""

    def __init__(self, run, mesh, device, memory=None):
        model = ParallelGPT(run.model, mesh.group("tp"), run.layout.sequence_parallel, seed=run.seed,
                            dtype=run.param_dtype, device=device)
        super().__init__(run, mesh.group("dp"), device, memory, model=model)

    def pieces(self, what: str) -> list:
        return tp_pieces(self.model, what)


def tp_pieces(module, what: str) -> list:
    """Contract 4 for modules whose weights may be TP slices (`tp_index`, padding cut off by
    `tp_rows`); other parameters are whole."""
    out = []
    for name, p in module.named_parameters():
        t = p if what == "param" else p.grad
        if t is None:
            continue
        index = getattr(p, "tp_index", None)
        piece = Piece(name, p.tp_full_shape, index) if index is not None else Piece(name, tuple(p.shape))
        t = t[p.tp_rows] if index is not None else t
        out.append((piece, t.detach().to("cpu", torch.float64).clone()))
    return out


class Zero:
    def __init__(self, run, dp, device, memory=None):
        master = torch.float64 if run.dtype == "float64" else torch.float32
        self.model = GPT(run.model, seed=run.seed, dtype=master, device=device)
        self.engine = ZeroDataParallel(self.model, dp, run.layout.zero, lr=run.lr, betas=run.betas,
                                       weight_decay=run.weight_decay, compute_dtype=DTYPES[run.dtype],
                                       reduce_dtype=DTYPES[run.reduce_dtype] if run.reduce_dtype else None,
                                       memory=memory)
        self.params = list(self.model.parameters())
        self.autocast = contextlib.nullcontext()

    def forward(self, tokens, targets):
        return self.engine(tokens, targets)

    def no_sync(self):
        return self.engine.no_sync()

    def scale_loss(self, loss):
        return self.engine.scale_loss(loss)

    def step(self) -> None:
        self.engine.step()

    def pieces(self, what: str) -> list:
        return [(Piece(name, shape, flat=rng), t) for name, shape, rng, t in self.engine.snapshot(what)]

    def model_states(self) -> dict:
        return self.engine.model_states()


class Pipeline:
    """Pipeline parallelism over the pp axis (each rank v model chunks, Megatron-split over
    tp when tp > 1), DDP per chunk over dp. Runs a whole step of microbatches itself (`run_step`) through the executor."""

    def __init__(self, run, mesh, device, memory=None, unit_costs=None):
        layout, cfg = run.layout, run.model
        self.pp, self.dp = mesh.group("pp"), mesh.group("dp")
        p, v, r = layout.pp, layout.virtual_stages, self.pp.rank
        ranges = partition(cfg.n_layers, p * v, layout.stage_layers)
        stages = [c * p + r for c in range(v)]
        tp = mesh.group("tp") if layout.tp > 1 else None
        self.chunks = [PipelineStage(cfg, ranges[s], s == 0, s == p * v - 1, seed=run.seed, dtype=run.param_dtype,
                                     device=device, tp_group=tp, sequence_parallel=layout.sequence_parallel)
                       for s in stages]
        self.ddps = [DistributedDataParallel(ch, self.dp, bucket_cap_mb=run.bucket_cap_mb, label=f"ddp.stage{s}")
                     for ch, s in zip(self.chunks, stages)]
        self.params = [q for ch in self.chunks for q in ch.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=run.lr, betas=run.betas, weight_decay=run.weight_decay)
        actions = build_schedule(layout.schedule, p, layout.microbatches, v)[r]
        self.executor = PipelineExecutor(self.chunks, self.pp, actions, v, ddps=self.ddps, unit_costs=unit_costs,
                                         hidden_dtype=run.param_dtype)
        self.autocast = (torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
                         if run.dtype == "bfloat16" else contextlib.nullcontext())

    def run_step(self, micro, tracking):
        with tracking(), self.autocast:
            total = self.executor.run([mb[:, :-1] for mb in micro], [mb[:, 1:] for mb in micro])
        # the loss is on the last stage's rank: every rank of the pipeline reports it
        self.pp.broadcast(total, src=self.pp.size - 1, label="metrics.loss_pp")
        return total

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def pieces(self, what: str) -> list:
        return [x for ch in self.chunks for x in tp_pieces(ch, what)]

    def model_states(self) -> dict:
        return MemoryTracker.model_states(nn.ModuleList(self.chunks), self.optimizer)


def build(run, mesh, device, memory=None):
    if run.layout.pp > 1:
        return Pipeline(run, mesh, device, memory)
    if run.layout.tp > 1 or run.layout.sequence_parallel:
        return TensorParallel(run, mesh, device, memory)
    cls = Zero if run.layout.zero or run.dtype == "float16" else DataParallel
    return cls(run, mesh.group("dp"), device, memory)
