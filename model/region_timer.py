"""The host's time inside compiled regions (model/compiled.py, `region`), timed where they run:
each forward call from its start to its return, and its backward from the moment autograd
starts the node its outputs hang from (AOTAutograd's CompiledFunctionBackward: Ansel et al.
2024, "PyTorch 2"; a CUDA graph site's replay node) to the moment it ends, through the node's
pre-hook and hook. No profiler: its per-op cost would be counted in what it measures.

`playground calibrate` times a training step's regions so (playground/calibrate.py,
`measure_program`): what the host spends in them is priced per op of their graphs
(Hardware.region_op_floor), the rest of the step per eager op (Hardware.kernel_floor).

The timer is found where `region` runs through `timing_regions`, which sets it for the code
inside in a context variable: a thread's own (each simulated rank runs in its own thread, and
starts with none), as torch's dispatch-mode stack is, which the simulator's other instruments
are found on (model/regions.py); no state shared between ranks."""
from __future__ import annotations

import contextlib
import contextvars
import time

import torch
from torch.utils._pytree import tree_leaves

_TIMER = contextvars.ContextVar("region_timer", default=None)  # the thread's RegionTimer, or None

# autograd nodes of views, between an output a compiled call returns as a view of another and
# the call's own node
_VIEWS = ("View", "Alias", "AsStrided", "Select", "Slice", "Unbind", "Split", "Unsqueeze", "Squeeze",
          "Expand", "Permute", "Transpose", "T")


class RegionTimer:
    """Host seconds in compiled regions: `seconds` in all so far, `calls` the (name, "forward"
    or "backward", seconds) of each in the order they ended."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = []

    def _add(self, name: str, way: str, seconds: float) -> None:
        self.seconds += seconds
        self.calls.append((name, way, seconds))

    def timed(self, name: str, call):
        """call()'s result, its host time and its backward node's added."""
        start = time.perf_counter()
        out = call()
        self._add(name, "forward", time.perf_counter() - start)
        node = backward_node(out)
        if node is not None:
            began = []
            node.register_prehook(lambda grads: began.append(time.perf_counter()))
            node.register_hook(lambda inputs, outputs: self._add(name, "backward", time.perf_counter() - began.pop()))
        return out


def backward_node(out):
    """The autograd node a region's outputs come from: the first output's with a gradient
    function, below the view nodes on it; None where no output has one."""
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            node = t.grad_fn
            while node.name().removesuffix("Backward0").removesuffix("Backward1") in _VIEWS \
                    and node.next_functions and node.next_functions[0][0] is not None:
                node = node.next_functions[0][0]
            return node
    return None


def region_timer() -> RegionTimer | None:
    """The timer `timing_regions` set for this thread, or None (never inside code torch.compile
    traces: a call there is part of the caller's graph)."""
    return None if torch.compiler.is_compiling() else _TIMER.get()


@contextlib.contextmanager
def timing_regions(timer: RegionTimer | None):
    """Every compiled region's call inside timed by `timer` (None: none)."""
    token = _TIMER.set(timer)
    try:
        yield timer
    finally:
        _TIMER.reset(token)
