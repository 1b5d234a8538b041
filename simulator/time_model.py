"""`SimulatedTime`: the simulator's model of time, plugged into the simulated backend
(`launch(fn, n, time_model=SimulatedTime("h100-sxm"))`).

Per rank: a `RankClock` (clock.py: a compute stream and one communication stream per
group) and a `ComputeModel` (compute_model.py: counts the ops the rank runs). A
collective starts when its last member is ready and lasts its alpha-beta cost on the
profile's topology (cost_model.py); the ledger gets the algorithm the cost model chose.
"""
from __future__ import annotations

from dataclasses import dataclass

from collectives.timing import TimeModel

from .clock import RankClock
from .compute_model import ComputeModel
from .cost_model import bytes_per_rank, collective_cost
from .hardware import Hardware, load_hardware


@dataclass
class RankTiming:
    """What `group.timing` gives a rank: its clock and its compute model."""
    clock: RankClock
    compute_model: ComputeModel


class SimulatedTime(TimeModel):
    def __init__(self, hardware: Hardware | str):
        self.hardware = load_hardware(hardware) if isinstance(hardware, str) else hardware
        self.ranks: list = []

    @property
    def clocks(self) -> list:
        return [r.clock for r in self.ranks]

    def start(self, world_size: int) -> None:
        self.ranks = []
        for _ in range(world_size):
            clock = RankClock(self.hardware.overlap_slowdown)
            self.ranks.append(RankTiming(clock, ComputeModel(self.hardware, clock)))

    def rank_context(self, rank: int):
        return self.ranks[rank].compute_model

    def issued(self, rank: int, stream, tag, alone: bool = False) -> float:
        clock = self.ranks[rank].clock
        if not alone:  # a group of one rank costs the host nothing (the torch backend's `_alone`)
            clock.issue_call(self.hardware.call_floor)
        return clock.ready(stream, tag)

    def schedule(self, op, size, group, members, stream):
        start = max(ready for _, ready in members)
        cost, algorithm = collective_cost(op, size, group, self.hardware)
        end = start + cost
        for rank, _ in members:
            self.ranks[rank].clock.occupy(stream, end)
        return start, end, algorithm, bytes_per_rank(op, algorithm, size, group, self.hardware)

    def waited(self, rank, start, end, label=None, alone: bool = False) -> None:
        # a pipeline's sends and receives, and the broadcast of its loss from the last stage
        pipeline = label is not None and (label.startswith("pp.") or label == "metrics.loss_pp")
        self.ranks[rank].clock.wait(start, end, pipeline=pipeline, in_flight=not alone)

    def rank_view(self, rank: int) -> RankTiming:
        return self.ranks[rank]

