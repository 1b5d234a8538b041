"""The simulated clock of one rank (docs/architecture.md, Contract 3): a compute stream and, per
process group, a communication stream (as ProcessGroupNCCL keeps one stream per group).

- Compute advances by the modelled time of each op the rank runs (`advance`).
- A call is *ready* on its group's stream when the rank issues it and the stream has
  finished its previous call; a collective starts when its last member is ready and
  lasts its alpha-beta cost; every member's stream is then busy until it ends.
- Waiting for a call (a blocking call, or `Work.wait()`) moves compute to the call's end
  if it is later. That stall is split into *idle* (before the call started: waiting for
  the last member) and *exposed communication* (after it started). The idle spent on a
  pipeline's sends and receives and on the broadcast of its loss (time_model.py says
  which calls) is also kept apart as the *bubble*. An async call whose
  end is already behind compute when it is waited adds nothing: it was hidden.

Record and replay. Counting every op through Python costs more than the op itself on
small models (and serialises the rank threads on the GIL), while the steps of a training
loop repeat the same ops. So a step can be *recorded*: the clock keeps, in order, each
communication event of the rank (a call issued on a stream, a wait) with the compute
counted since the previous one. A *replayed* step runs with op counting off and, at each
event, charges the recorded compute, after checking that the event is the one recorded
at that position (`ReplayMismatchError` otherwise: the step did not repeat, so its
compute is unknown, and the run stops rather than report a wrong time).
"""
from __future__ import annotations


class ReplayMismatchError(RuntimeError):
    """A replayed step issued other communication than the recorded one."""


class RankClock:
    __slots__ = ("now", "streams", "compute", "exposed", "idle", "bubble", "segments", "_segment_start",
                 "_script", "_mode", "_pos", "_since")

    def __init__(self):
        self.now = 0.0  # the compute stream's time
        self.streams: dict = {}  # group key -> time its communication stream is free
        self.compute = 0.0  # seconds of modelled compute
        self.exposed = 0.0  # seconds compute stalled on communication
        self.idle = 0.0  # seconds compute stalled waiting for peers to arrive
        self.bubble = 0.0  # the part of idle spent waiting on pipeline neighbours (pp.* calls)
        self.segments: list = []  # (start, end) of the compute between calls, for traces
        self._segment_start = 0.0
        self._script: list = []  # the recorded step: (event, compute before it), then the tail
        self._mode = None  # None (count ops), "record" or "replay"
        self._pos = 0
        self._since = 0.0

    # -- record and replay --------------------------------------------------------------
    def begin_step(self, mode) -> None:
        """Start a step that is counted as usual (None), recorded or replayed."""
        if mode not in (None, "record", "replay"):
            raise ValueError(f"step mode must be None, 'record' or 'replay', not {mode!r}")
        if mode == "replay" and not self._script:
            raise ReplayMismatchError("a step can be replayed only after one was recorded")
        self._mode, self._pos, self._since = mode, 0, self.compute
        if mode == "record":
            self._script = []

    def end_step(self) -> None:
        """End the step: record or charge the compute after its last event."""
        if self._mode == "record":
            self._script.append(("end of step", self.compute - self._since))
        elif self._mode == "replay":
            self._event("end of step")
        self._mode = None

    def _event(self, what) -> None:
        if self._mode == "record":
            self._script.append((what, self.compute - self._since))
            self._since = self.compute
        elif self._mode == "replay":
            if self._pos >= len(self._script) or self._script[self._pos][0] != what:
                expected = self._script[self._pos][0] if self._pos < len(self._script) else "nothing more"
                raise ReplayMismatchError(
                    f"replayed step, communication event #{self._pos}: the recorded step had {expected!r} here, "
                    f"this step has {what!r}. Steps that differ cannot be replayed; count every step instead "
                    f"(playground train --count-every-step).")
            self.advance(self._script[self._pos][1])
            self._pos += 1

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.compute += seconds

    def _close_segment(self) -> None:
        if self.now > self._segment_start:
            self.segments.append((self._segment_start, self.now))
        self._segment_start = self.now

    def ready(self, stream, what=None) -> float:
        """When a call issued now can start on `stream` (`what` describes the call, for
        replay: a replayed step must issue the same calls with the same shapes)."""
        self._event(("call", stream, what))
        self._close_segment()
        return max(self.now, self.streams.get(stream, 0.0))

    def occupy(self, stream, end: float) -> None:
        self.streams[stream] = end

    def wait(self, start: float, end: float, pipeline: bool = False) -> None:
        """Compute waits for a call that ran over [start, end]; `pipeline`: a send or receive
        between pipeline stages, whose idle is the pipeline's bubble (Huang et al. 2019)."""
        self._event("wait")
        self._close_segment()
        if end <= self.now:
            return
        if start > self.now:
            self.idle += start - self.now
            if pipeline:
                self.bubble += start - self.now
        self.exposed += end - max(start, self.now)
        self.now = self._segment_start = end

    def finish(self) -> None:
        """Close the last compute segment (when the rank's program returns)."""
        self._close_segment()

    def breakdown(self) -> dict:
        return {"time": self.now, "compute": self.compute, "exposed_comm": self.exposed, "idle": self.idle,
                "bubble": self.bubble}
