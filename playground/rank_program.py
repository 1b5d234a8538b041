"""One rank of a run, as the training loop, the planner and the bubble measurement all drive
it: the mesh of its layout, the parallelized model, this rank's rows of each global batch and
their microbatches, and the step's three parts (forward and backward of the microbatches, the
optimizer, the loss averaged over the data-parallel replicas).

Global batch semantics (docs/architecture.md, "Composition"): every rank draws the same
global batch of `global_batch` sequences; its dp rank takes rows [dp·rows, (dp + 1)·rows),
rows = global_batch / dp, split into microbatches of `micro_batch_size` sequences; context
and sequence parallelism split the sequence later, inside the model.
"""
from __future__ import annotations

import torch

from collectives import ReduceOp
from model import GPT
from model.regions import attention_kernels
from simulator import MemoryTracker

from .data_parallel import data_parallel_group, model_groups
from .faults import LaggedCheck, nonfinite
from .parallelize import parallelize


class RankProgram:
    """This rank's part of `run` on `world` (a ProcessGroup of all ranks)."""

    def __init__(self, world, run, device: str, dtype=None, state_dict=None):
        """`dtype`: the reference model's parameter dtype (default the run's); `state_dict`: the
        reference GPT's weights to start from instead of (seed, name)."""
        layout = run.layout
        self.run, self.world = run, world
        self.mesh = layout.mesh(world)
        self.dp = self.mesh.group("dp")
        self.replicas = data_parallel_group(self.mesh, layout)  # dp × cp: the loss is averaged over it
        # model states and communication buffers are always accounted (cheap: strategies report
        # their buffers to the rank's instruments); activations only where a caller tracks them
        # (`track`)
        self.memory = world.instruments.memory = MemoryTracker()
        self.model = parallelize(GPT(run.model, dtype=dtype or run.param_dtype, device="meta"), self.mesh, run,
                                 device, state_dict=state_dict)
        n = layout.global_batch // layout.dp
        self.rows = slice(self.dp.rank * n, (self.dp.rank + 1) * n)  # this rank's rows of each global batch
        self.everyone = model_groups(self.mesh)  # the NaN check's groups (the world)

    def local(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (rows of seq_len + 1 tokens)."""
        return batch[self.rows]

    def microbatches(self, local: torch.Tensor) -> tuple:
        """This rank's rows split into the step's microbatches."""
        return local.split(self.run.layout.micro_batch_size)

    def track(self):
        """The context in which autograd's saved tensors are counted as activations."""
        return self.memory.track_activations(exclude=self.model.params)

    def forward_backward(self, micro, track=None) -> torch.Tensor:
        """The step's microbatches forward and backward; this rank's share of the loss."""
        with attention_kernels(self.run.model.attention):  # (FlashAttention-1's are priced slower)
            return self.model.run_step(micro, track or self.track)

    def update(self, found_inf: torch.Tensor | None = None) -> None:
        """The optimizer's step; skipped on the device where `found_inf` (0-d, 1.0) says so."""
        self.model.step(found_inf)

    def nonfinite(self, total: torch.Tensor) -> str | None:
        """A NaN or an Inf in any rank's loss or gradients, found alike on every rank before the
        optimizer step (playground/faults.py); None with --on-nan off. Under fp16 the loss
        scaler's overflow check keeps the gradients: the loss alone is checked."""
        if self.run.on_nan == "off":
            return None
        return nonfinite(self.model, total, self.world, self.everyone, check_grads=self.run.dtype != "float16")

    def nonfinite_lagged(self, lagged: LaggedCheck, step: int, total: torch.Tensor) -> torch.Tensor:
        """The check of `nonfinite`, read a step late (`LaggedCheck`): `found` on the device."""
        return lagged.check(step, self.model, total, self.world, self.everyone, check_grads=self.run.dtype != "float16")

    def average_loss(self, total: torch.Tensor, async_op: bool = False):
        """The loss averaged over the data-parallel replicas, in place (one small all-reduce,
        `metrics.loss`); the Work with `async_op`."""
        return self.replicas.all_reduce(total, op=ReduceOp.AVG, label="metrics.loss", async_op=async_op)

    def memory_snapshot(self) -> dict:
        """The memory tracker's peaks, with the model states as they are now."""
        return self.memory.snapshot(states=MemoryTracker.measure(self.model.state_tensors()))
