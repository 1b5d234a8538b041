"""Regions of code marked for the simulator: ops that a GPU runs as one kernel, which the
CPU and meta ranks run op by op, priced and counted as that one kernel (`fused_kernel`,
`optimizer_kernel`: the compute model, simulator/compute_model.py; the memory tracker,
simulator/memory.py); the kernels of one compiled graph, which a GPU launches from one call
(`compiled_kernels`: the compute model), and within one the ops fused into their consumers
(`inlined`); the ops a selective checkpoint's dispatch mode sees (`selective_checkpoint`);
the generation of its flash attention kernels
(`attention_kernels`); a storage resized (`resize_storage`); a pipeline stage's compute action
(`pipeline_action`, which a bubble measurement charges a fixed cost); and the tracker
counting activations now (`activation_tracker`).

This is the simulator's one channel into the model and the strategies' arithmetic: the
rank's dispatch modes (each rank's program runs under its own, thread by thread), found on
the current mode stack where they are on. Code that marks a region sees nothing of them in
its constructor and runs unchanged where none is on (a GPU, the torch backend). What a
strategy allocates outside the model's tensors is told to `group.instruments` instead
(collectives/instruments.py)."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def _modes() -> list:
    """The rank's dispatch modes, innermost first; none inside code torch.compile traces (no
    simulator mode runs with it, and reading the mode stack would break its graph there)."""
    if torch.compiler.is_compiling():
        return []
    return list(reversed(_get_current_dispatch_mode_stack()))


@contextlib.contextmanager
def fused_kernel(io_bytes: int, name: str, attention: bool = False, graph: bool = False, optimizer: bool = False):
    """The ops inside as one kernel moving io_bytes, for the simulator's dispatch modes when
    they are on (each mode with `fused`: the compute model prices the region as one kernel,
    simulator/compute_model.py; the memory tracker counts only what the region leaves,
    simulator/memory.py); else nothing. `attention`: a FlashAttention call (ring attention's
    blocks), priced at the attention rate whatever dtype its matmuls are written in. `graph`:
    the call of a compiled region's forward graph (model/compiled.py), whose host cost goes
    by the ops inside where the profile prices them (Hardware.region_op_floor). `optimizer`: an
    optimizer's pass over a flat unit, its bytes at the rate such passes reach
    (Hardware.optimizer_hbm_fraction)."""
    with contextlib.ExitStack() as stack:
        for mode in _modes():
            if hasattr(mode, "fused"):
                stack.enter_context(mode.fused(io_bytes, name, attention=attention, graph=graph, optimizer=optimizer))
        yield


@contextlib.contextmanager
def compiled_kernels(name: str):
    """The ops inside as the kernels of one compiled graph, for the compute model when it is
    on (`compiled`: each op's device time as its own kernel, the host's as one call); the
    memory tracker sees them op by op. Else nothing."""
    with contextlib.ExitStack() as stack:
        for mode in _modes():
            if hasattr(mode, "compiled"):
                stack.enter_context(mode.compiled(name))
        yield


@contextlib.contextmanager
def inlined():
    """The ops inside, within a compiled graph (`compiled_kernels`), run inside the kernels
    that consume their outputs (a compiled backward's recomputation of what its forward did
    not save, which Inductor fuses into them): for each mode with `inlined`, no bytes moved
    (the compute model) and no tensor held (the memory tracker, the live count). Else nothing."""
    with contextlib.ExitStack() as stack:
        for mode in _modes():
            if hasattr(mode, "inlined"):
                stack.enter_context(mode.inlined())
        yield


@contextlib.contextmanager
def selective_checkpoint():
    """The ops inside pass through torch's selective-checkpoint dispatch mode (a block's
    forward or recomputation under a selective policy), for the compute model when it is on
    (`selective_checkpoint`: the host's extra cost per op). Else nothing."""
    with contextlib.ExitStack() as stack:
        for mode in _modes():
            if hasattr(mode, "selective_checkpoint"):
                stack.enter_context(mode.selective_checkpoint())
        yield


@contextlib.contextmanager
def attention_kernels(generation: str):
    """The flash attention ops inside (forward and backward: a step's) priced as the kernels
    of `generation` (the model's `attention`), for the compute model when it is on
    (`attention_kernels`: simulator/compute_model.py, FLASH_GENERATIONS); else nothing."""
    with contextlib.ExitStack() as stack:
        for mode in _modes():
            if hasattr(mode, "attention_kernels"):
                stack.enter_context(mode.attention_kernels(generation))
        yield


@contextlib.contextmanager
def optimizer_kernel(optimizer):
    """`optimizer.step()` inside as the one fused kernel a GPU runs for it (torch's fused
    AdamW: each mode with `optimizer_step`, the compute model); else nothing."""
    with contextlib.ExitStack() as stack:
        for mode in _modes():
            if hasattr(mode, "optimizer_step"):
                stack.enter_context(mode.optimizer_step(optimizer))
        yield


def resize_storage(t: torch.Tensor, nbytes: int) -> None:
    """`t`'s storage resized to nbytes (ZeRO-3 frees its gathered parameters so and fills them
    again, as FSDP does), told to each mode with `storage_resized` (the live count,
    simulator/live_bytes.py): a storage's resize is no op a dispatch mode sees."""
    storage = t.untyped_storage()
    storage.resize_(nbytes)
    for mode in _modes():
        if hasattr(mode, "storage_resized"):
            mode.storage_resized(storage)


def activation_tracker():
    """The memory tracker counting this rank's activations now (its mode on the stack, while
    `MemoryTracker.track_activations` is on), or None: what activation checkpointing tells of
    the outputs its selective policy keeps outside autograd."""
    for mode in _modes():
        tracker = getattr(mode, "activation_tracker", None)
        if tracker is not None:
            return tracker
    return None


@contextlib.contextmanager
def pipeline_action(kind: str, chunks: int = 1):
    """One compute action of a pipeline schedule (F, B, I or W of one chunk, of `chunks` per
    rank): where a mode charges actions fixed costs (the compute model with `unit_costs`, the
    bubble measurement), the ops inside are not counted and the action's cost is charged."""
    with contextlib.ExitStack() as stack:
        for mode in _modes():
            if getattr(mode, "unit_costs", None) is not None:
                stack.enter_context(mode.pipeline_action(kind, chunks))
                break
        yield
