"""Fused regions: ops that a GPU runs as one kernel, which the CPU and meta ranks run op by
op, marked so that the simulator prices and counts them as that one kernel (the compute
model, simulator/compute_model.py; the memory tracker, simulator/memory.py)."""
from __future__ import annotations

import contextlib

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


@contextlib.contextmanager
def fused_kernel(io_bytes: int, name: str):
    """The ops inside as one kernel moving io_bytes, for the simulator's dispatch modes when
    they are on (each mode with `fused`: the compute model prices the region as one kernel,
    simulator/compute_model.py; the memory tracker counts only what the region leaves,
    simulator/memory.py); else nothing."""
    with contextlib.ExitStack() as stack:
        for mode in reversed(_get_current_dispatch_mode_stack()):
            if hasattr(mode, "fused"):
                stack.enter_context(mode.fused(io_bytes, name))
        yield
