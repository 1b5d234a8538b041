"""Each training step's time as the device saw it: a CUDA event recorded on the stream where
each step starts and another where it ends, the time between the two read after the run.

The host's wall time per step is the device's only where the host waits for the device once a
step. Without such a wait (the gradients' NaN check read a step late, `--on-nan off`) the host
launches ahead of the device and its steps are shorter than the device's until the launch
queue or the caching allocator stops it; a median of the host's steps then overstates the
throughput (benchmarks/results/gpu/run61_late_read_profiled: a median of 39.7 ms on a device
whose period was 47.9 ms). The events cost a launch each and no wait (CUDA programming guide,
"Events"). The interval between a step's two events holds what the device did for the step
and its idle time waiting for the host's launches, so a host-bound step reads its true
length too; what the host does between steps (writing a checkpoint) is left out, as the
host's own step times leave it out.
"""
from __future__ import annotations

import torch


class DeviceSteps:
    """`started()` and `ended()` around each step; `seconds()` after the run: each step's time
    on the device."""

    def __init__(self):
        self.marks = []  # [(start, end)] events

    @staticmethod
    def _mark():
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream, after everything launched on it so far
        return event

    def started(self) -> None:
        self.marks.append((self._mark(), None))

    def ended(self) -> None:
        self.marks[-1] = (self.marks[-1][0], self._mark())

    def seconds(self) -> list:
        if self.marks:
            self.marks[-1][1].synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in self.marks]
