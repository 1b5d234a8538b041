"""What a rank's program is measured by, beside its clock: one object per rank, shared by
every process group the rank holds (`group.instruments`), set by the program that drives the
rank (a training step, a plan) and read where a strategy allocates what a profiler would not
see as a tensor of the model: communication buffers and the gradients that live from
backward to the optimizer step. Strategies read it through the groups they already hold, so
no constructor takes it; the model and the arithmetic inside strategies are priced through
the rank's dispatch modes instead (model/instruments.py).

Kept per rank, never in a module global: the simulated ranks share one process."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Instruments:
    memory: object = None  # a simulator.MemoryTracker, or None: nothing is accounted
