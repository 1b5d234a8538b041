"""The simulated clock of one rank (docs/architecture.md, Contract 3): a compute stream and, per
process group, a communication stream (as ProcessGroupNCCL keeps one stream per group).

- Compute advances by the modelled time of each op the rank runs (`launch`): host and
  device are two queues. The host issues each op one floor after the previous one; the
  device runs it once it is issued and the previous op is done, so before an op the host
  has not issued yet the device waits (kept apart as *host*: the step is then the host's
  issuing, not the device's work). A value read on the host (`synchronize`) makes the
  host wait for the device; so does waiting a call when more than `MAX_IN_FLIGHT` waited
  calls are unfinished on the device (the host then waits for the oldest: the torch
  backend's bound on its run-ahead, `DeviceTimes`); each step starts with the two in step.
- Issuing a call costs the host the profile's `call_floor` (the process group's own
  work and the backend's call; the device may wait for it like for an op). A call is
  *ready* on its group's stream when the rank issues it and the stream has finished its
  previous call; a collective starts when its last member is ready and
  lasts its alpha-beta cost; every member's stream is then busy until it ends.
- While a call is in flight its kernels share the GPU with the compute stream's: NCCL's
  take SMs (an all-gather 24 of an H100's 132) and memory bandwidth, so compute that
  overlaps communication runs slower, by 18.9% on average (at most 40%) on A100s and
  H100s (Lee et al. 2025, "Characterizing Compute-Communication Overlap in GPU-
  Accelerated Distributed Deep Learning"). When the rank waits for a call, the compute
  it ran since the call started (up to the call's end) is stretched by the profile's
  `overlap_slowdown` (once per call; `contention` sums the stretch, a span of its own in
  the timeline); a blocking call overlaps nothing, its compute having waited.
- Waiting for a call (a blocking call, or `Work.wait()`) moves compute to the call's end
  if it is later. That stall is split into *idle* (before the call started: waiting for
  the last member) and *exposed communication* (after it started). The idle spent on a
  pipeline's sends and receives and on the broadcast of its loss (time_model.py says
  which calls) is also kept apart as the *bubble*. An async call whose
  end is already behind compute when it is waited adds nothing: it was hidden.
- The timeline (`events`): the compute stream's time as it was spent, in order, each span
  what it is: a kernel (named by its op: `mm`, `flash_attention`, `_fused_adamw`), the
  device waiting for the host to issue (`host`), waiting for the last member of a call
  (`idle`, or `bubble` on a pipeline's calls), or for a call to finish (`exposed`). The
  plots and the Perfetto trace draw these (simulator/trace.py).

Record and replay. Counting every op through Python costs more than the op itself on
small models (and serialises the rank threads on the GIL), while the steps of a training
loop repeat the same ops. So a step can be *recorded*: the clock keeps, in order, each
communication event of the rank (a call issued on a stream, a wait) with the kernels
launched (and host reads) since the previous one. A *replayed* step runs with op
counting off and, at each event, launches the recorded kernels again through the two
queues (the host's lead depends on the waits, which may differ from the recorded step's),
after checking that the event is the one recorded at that position
(`ReplayMismatchError` otherwise: the step did not repeat, so its compute is unknown,
and the run stops rather than report a wrong time).
"""
from __future__ import annotations

import collections

MAX_IN_FLIGHT = 2  # waited calls the torch backend lets the host run ahead of (DeviceTimes)


class ReplayMismatchError(RuntimeError):
    """A replayed step issued other communication than the recorded one."""


class RankClock:
    __slots__ = ("now", "streams", "compute", "host", "issuing", "exposed", "idle", "bubble", "_script", "_mode", "_pos", "_ops", "issued", "in_flight", "events", "charged", "overlap_slowdown", "contention")

    def __init__(self, overlap_slowdown: float = 0.0):
        self.now = 0.0  # the compute stream's time
        self.streams: dict = {}  # group key -> time its communication stream is free
        self.compute = 0.0  # seconds of modelled compute
        self.host = 0.0  # seconds the device waited for the host to issue an op
        self.issuing = 0.0  # seconds the host spent issuing ops and calls (its floors)
        self.exposed = 0.0  # seconds compute stalled on communication
        self.idle = 0.0  # seconds compute stalled waiting for peers to arrive
        self.bubble = 0.0  # the part of idle spent waiting on pipeline neighbours (pp.* calls)
        self._script: list = []  # the recorded step: (event, the launches before it), then the tail
        self._mode = None  # None (count ops), "record" or "replay"
        self._pos = 0
        self._ops: list = []  # recording: the launches and host reads since the previous event
        self.issued = None  # when the host issued its last op (None: in step with the device)
        self.in_flight = collections.deque()  # when the device passes each waited call
        # the compute stream's spans, [kind, name, start, end]: kind "compute" (name: the op),
        # "host", "idle", "bubble" or "exposed"; a span continuing the last one of its kind
        # and name extends it
        self.events: list = []
        # calls already charged their contention, (start, end), and how much slower compute
        # runs beside a call in flight (the profile's overlap_slowdown; the module docstring)
        self.charged: set = set()
        self.overlap_slowdown = overlap_slowdown
        self.contention = 0.0  # seconds kernels were slowed by calls running beside them

    # -- record and replay --------------------------------------------------------------
    def begin_step(self, mode) -> None:
        """Start a step that is counted as usual (None), recorded or replayed."""
        if mode not in (None, "record", "replay"):
            raise ValueError(f"step mode must be None, 'record' or 'replay', not {mode!r}")
        if mode == "replay" and not self._script:
            raise ReplayMismatchError("a step can be replayed only after one was recorded")
        self._mode, self._pos, self._ops, self.issued = mode, 0, [], None
        self.in_flight.clear()
        if mode == "record":
            self._script = []

    def end_step(self) -> None:
        """End the step: record or charge the compute after its last event."""
        if self._mode == "record":
            self._script.append(("end of step", self._ops))
        elif self._mode == "replay":
            self._event("end of step")
        self._mode = None

    def _event(self, what) -> None:
        if self._mode == "record":
            self._script.append((what, self._ops))
            self._ops = []
        elif self._mode == "replay":
            if self._pos >= len(self._script) or self._script[self._pos][0] != what:
                expected = self._script[self._pos][0] if self._pos < len(self._script) else "nothing more"
                raise ReplayMismatchError(
                    f"replayed step, communication event #{self._pos}: the recorded step had {expected!r} here, "
                    f"this step has {what!r}. Steps that differ cannot be replayed; count every step instead "
                    f"(playground train --count-every-step).")
            for op in self._script[self._pos][1]:
                self._apply(*op)
            self._pos += 1

    def advance(self, seconds: float, name: str = "fixed cost") -> None:
        """Compute for `seconds` (a fixed cost, outside the two queues)."""
        self._apply(None, seconds, name)

    def launch(self, floor: float, seconds: float, name: str = "kernel") -> None:
        """The host issues a kernel `floor` after its previous one; the device runs it for
        `seconds` once issued and free."""
        self._apply(floor, seconds, name)

    def issue_call(self, floor: float) -> None:
        """The host issues a collective: `floor` of host time and none of the device's (a
        replayed step re-launches it from the recording)."""
        if self._mode != "replay":
            self._apply(floor, 0.0, None)

    def synchronize(self) -> None:
        """The host waits for the device (a value read on the host)."""
        self._apply(None, None, None)

    def _span(self, kind: str, name, start: float, end: float) -> None:
        if end <= start:
            return
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == kind and last[1] == name and last[3] == start:
            last[3] = end
        else:
            self.events.append([kind, name, start, end])

    def _apply(self, floor, seconds, name=None) -> None:
        if self._mode == "record":
            self._ops.append((floor, seconds, name))
        if seconds is None:
            if self.issued is not None:
                self.issued = max(self.issued, self.now)
            return
        if floor is not None:
            self.issuing += floor
            self.issued = (self.now if self.issued is None else self.issued) + floor
            if self.issued > self.now:  # the device idles until the host issues the op
                self._span("host", None, self.now, self.issued)
                self.host += self.issued - self.now
                self.now = self.issued
        if seconds:
            self._span("compute", name, self.now, self.now + seconds)
        self.now += seconds
        self.compute += seconds

    def ready(self, stream, what=None) -> float:
        """When a call issued now can start on `stream` (`what` describes the call, for
        replay: a replayed step must issue the same calls with the same shapes)."""
        self._event(("call", stream, what))
        return max(self.now, self.streams.get(stream, 0.0))

    def occupy(self, stream, end: float) -> None:
        self.streams[stream] = end

    def wait(self, start: float, end: float, pipeline: bool = False, in_flight: bool = True) -> None:
        """Compute waits for a call that ran over [start, end]; `pipeline`: a send or receive
        between pipeline stages, whose idle is the pipeline's bubble (Huang et al. 2019);
        `in_flight=False`: a call the backend did not hand to the device's queue (a group of
        one rank), which the run-ahead bound does not count."""
        self._event("wait")
        if self.overlap_slowdown and (start, end) not in self.charged and min(end, self.now) > start:
            # the compute since the call started ran beside it (see the module docstring)
            extra = self.overlap_slowdown * (min(end, self.now) - start)
            self._span("compute", "contention", self.now, self.now + extra)
            self.now += extra
            self.compute += extra
            self.contention += extra
        if self.overlap_slowdown:
            self.charged.add((start, end))
            if len(self.charged) > 4096:  # (calls that ended before now cannot be waited again)
                self.charged = {c for c in self.charged if c[1] > self.now}
        if end > self.now:
            if start > self.now:
                self._span("bubble" if pipeline else "idle", None, self.now, start)
                self.idle += start - self.now
                if pipeline:
                    self.bubble += start - self.now
            self._span("exposed", None, max(start, self.now), end)
            self.exposed += end - max(start, self.now)
            self.now = end
        if not in_flight:
            return
        self.in_flight.append(self.now)
        if len(self.in_flight) > MAX_IN_FLIGHT:  # the host waits until the device passes the oldest
            passed = self.in_flight.popleft()
            self.issued = passed if self.issued is None else max(self.issued, passed)

    def breakdown(self) -> dict:
        return {"time": self.now, "compute": self.compute, "host": self.host, "issuing": self.issuing,
                "exposed_comm": self.exposed, "idle": self.idle,
                "bubble": self.bubble}
