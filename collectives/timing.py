"""The hook through which a model of time plugs into the simulated backend.

The process-group layer knows nothing of hardware: without a time model simulated calls
take no time. A time model (the `simulator` package provides one, `SimulatedTime`) is
told when each rank issues a call and when it waits for one, and decides when each call
starts and ends. `schedule` is called under the world's lock when a call's last member
arrives, so the calls of one group are timed in their program order.
"""
from __future__ import annotations

import contextlib


class TimeModel:
    """The interface; every method has a neutral default (no time passes)."""

    def start(self, world_size: int) -> None:
        """Before the rank threads start."""

    def rank_context(self, rank: int):
        """Wraps the program of `rank` in its thread (e.g. op counting)."""
        return contextlib.nullcontext()

    def issued(self, rank: int, stream, tag, alone: bool = False) -> float:
        """When a call `rank` issues now could start on `stream` (`tag` describes the call:
        op, label, dtype, shape, splits; `alone`: its group is this rank alone, whose calls
        the torch backend does itself, with no call to torch.distributed)."""
        return 0.0

    def schedule(self, op: str, size: int, group: tuple, members: list, stream) -> tuple:
        """(start, end, algorithm, moved) of a call of `op` with message size `size` on the
        global ranks `group`; `members` is [(rank, ready time)]. `moved` is (sent, received)
        bytes per rank where the chosen algorithm is not the ring, else None."""
        return 0.0, 0.0, None, None

    def waited(self, rank: int, start: float, end: float, label: str | None = None, alone: bool = False) -> None:
        """`rank` waited for a call (labelled `label`) that ran over [start, end] (`alone`: as
        `issued`'s)."""

    def rank_finished(self, rank: int) -> None:
        """The program of `rank` returned."""

    def rank_view(self, rank: int):
        """What a rank's process groups expose as `group.timing` (None: nothing): the rank's
        clock and compute model, for the programs that drive them (a training step, a plan).
        Strategies mark fused kernels through the rank's dispatch modes instead
        (model/regions.py), never through this."""
        return None

