"""Each training step's time as the device saw it: a CUDA event recorded on the stream where
each step ends, the time between two successive ones read after the run.

The host's wall time per step is the device's only where the host waits for the device once a
step (the gradients' NaN check reads its flags on the host). Without such a wait (`--on-nan
off`, or a check read a step late) the host launches ahead of the device and its steps are
shorter than the device's until the launch queue or the caching allocator stops it; a median
of the host's steps then overstates the throughput (a run of 12 steps of a 47.9 ms device
period read 39.7 ms on the host). The events cost a launch each and no wait (CUDA
programming guide, "Events"); the interval between two includes the device's idle time
waiting for the host, so a host-bound step reads its true length too.
"""
from __future__ import annotations

import torch


class DeviceSteps:
    """`ended()` after each step; `seconds()` after the run: each step's time on the device
    (from the previous step's end, the first from this object's making)."""

    def __init__(self):
        self.marks = [self._mark()]

    @staticmethod
    def _mark():
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream, after everything the step launched on it
        return event

    def ended(self) -> None:
        self.marks.append(self._mark())

    def seconds(self) -> list:
        self.marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
