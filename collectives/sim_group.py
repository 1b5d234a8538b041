"""`ProcessGroup` of the simulated backend: one object per rank per group, posting its
calls to the shared `SimWorld`."""
from __future__ import annotations

from .errors import CollectiveMismatchError
from .process_group import ProcessGroup, Work
from .sim_world import SimWorld, Slot

WORLD_KEY = ("world",)


class SimWork(Work):
    __slots__ = ("_world", "_slot", "_call")

    def __init__(self, world: SimWorld, slot: Slot, call):
        self._world, self._slot, self._call = world, slot, call

    def wait(self) -> bool:
        self._world.wait(self._slot, self._call.rank, self._call)
        return True

    def is_completed(self) -> bool:
        return self._slot.done


class SimProcessGroup(ProcessGroup):
    def __init__(self, world: SimWorld, key, ranks, global_rank: int):
        self._world = world
        self._key = key
        self.ranks = tuple(ranks)
        self.rank = self.ranks.index(global_rank)
        self.size = len(self.ranks)
        self._seq = 0  # this rank's number of collectives on this group so far

    @property
    def timing(self):
        """This rank's view of the time model (None without one): with the simulator's,
        `.clock` and `.compute_model`."""
        tm = self._world.time_model
        return tm.rank_view(self.ranks[self.rank]) if tm is not None else None

    @property
    def instruments(self):
        """This rank's Instruments (the same object from each of its groups)."""
        return self._world.ranks[self.ranks[self.rank]].instruments

    def stall(self) -> None:
        """Stop answering until the world stops (SimWorld.stall), then raise."""
        self._world.stall(self.ranks[self.rank])

    def _record(self, call) -> None:
        ledger = self._world.ledger
        ledger.record(call.make_entry(len(ledger.per_rank[call.rank])))

    def _issue(self, call) -> Work:
        world = self._world
        if world.live is not None:  # stand-ins: see sim_world
            live = world.live_members(call.group)
            if len(live) == 1 and len(call.group) > 1:  # (a send or recv to a peer of its own class too)
                return SimWork(world, world.complete_alone(self._key, call), call)
            if len(live) != len(call.group):
                raise CollectiveMismatchError(
                    f"rank {call.rank}: {call.op} on group {list(call.group)} mixes ranks that run ({live}) with "
                    f"stand-ins: planning by classes needs each group within one class or across classes' "
                    f"stand-ins only")
        if call.op in ("send", "recv"):
            slot = self._world.post_p2p(self._key, call)
        else:
            seq = self._seq
            self._seq += 1
            slot = self._world.post_collective(self._key, seq, call)
        return SimWork(self._world, slot, call)

    def new_group(self, ranks):
        members = self._members(ranks)
        me = self.ranks[self.rank]
        if me not in members:
            return None
        # The k-th group a rank makes over the same ranks is the k-th communicator, as in torch.
        made = self._world.ranks[me].group_creations
        k = made.get(members, 0)
        made[members] = k + 1
        return SimProcessGroup(self._world, (members, k), members, me)
