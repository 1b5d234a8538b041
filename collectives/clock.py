"""The simulated clock of one rank (DESIGN.md, Contract 3): a compute stream and, per
process group, a communication stream (as ProcessGroupNCCL keeps one stream per group).

- Compute advances by the modelled time of each op the rank runs (`advance`).
- A call is *ready* on its group's stream when the rank issues it and the stream has
  finished its previous call; a collective starts when its last member is ready and
  lasts its alpha-beta cost; every member's stream is then busy until it ends.
- Waiting for a call (a blocking call, or `Work.wait()`) moves compute to the call's end
  if it is later. That stall is split into *idle* (before the call started: waiting for
  the last member) and *exposed communication* (after it started). An async call whose
  end is already behind compute when it is waited adds nothing: it was hidden.
"""
from __future__ import annotations


class RankClock:
    __slots__ = ("now", "streams", "compute", "exposed", "idle", "segments", "_segment_start")

    def __init__(self):
        self.now = 0.0  # the compute stream's time
        self.streams: dict = {}  # group key -> time its communication stream is free
        self.compute = 0.0  # seconds of modelled compute
        self.exposed = 0.0  # seconds compute stalled on communication
        self.idle = 0.0  # seconds compute stalled waiting for peers to arrive
        self.segments: list = []  # (start, end) of the compute between calls, for traces
        self._segment_start = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.compute += seconds

    def _close_segment(self) -> None:
        if self.now > self._segment_start:
            self.segments.append((self._segment_start, self.now))
        self._segment_start = self.now

    def ready(self, stream) -> float:
        """When a call issued now can start on `stream`."""
        self._close_segment()
        return max(self.now, self.streams.get(stream, 0.0))

    def occupy(self, stream, end: float) -> None:
        self.streams[stream] = end

    def wait(self, start: float, end: float) -> None:
        """Compute waits for a call that ran over [start, end]."""
        self._close_segment()
        if end <= self.now:
            return
        if start > self.now:
            self.idle += start - self.now
        self.exposed += end - max(start, self.now)
        self.now = self._segment_start = end

    def finish(self) -> None:
        """Close the last compute segment (when the rank's program returns)."""
        self._close_segment()

    def breakdown(self) -> dict:
        return {"time": self.now, "compute": self.compute, "exposed_comm": self.exposed, "idle": self.idle}
