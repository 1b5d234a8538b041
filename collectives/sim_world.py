"""The simulated backend's runtime: N rank threads in one process, their rendezvous, and
the detection of mismatches, deadlocks and crashed ranks.

Every call is posted to a slot: a collective to (group, call number), a point-to-point
call to the FIFO channel (group, src, dst). The member that completes a slot validates
it and moves the data (`sim_ops`) outside the lock, then wakes exactly the ranks waiting
on it, each through its own lock (no notify_all herd).

Deadlock: a rank that must block registers what it waits for. When every live rank is
blocked (ranks that returned are not live), nothing can ever progress: the world raises
`DeadlockError` in every blocked rank at once, listing what each waits on and where.
Crash: when a rank raises, every blocked rank wakes with `RankAbortedError`, later calls
raise it too, and `launch` reports the original exception.
Hang: a rank that stops answering outside any call (`stall`: an injected hang) is not
blocked, so no deadlock is seen; a rank that waits in one call longer than `timeout`
seconds (NCCL's watchdog) stops the world with `CollectiveTimeoutError`, naming every rank
waiting, the call it waits in and the ranks that never arrived.

Stand-ins (planning at scale): only the `live` ranks run, each standing for a class of ranks
whose programs are identical (every rank of one pipeline stage, say). A collective on a
group where the caller is the only live member completes at once, on meta tensors (there
is no data), timed for the whole group as if every member arrived with it: identical
programs arrive together. Groups of several live members meet as usual; a group mixing
several live members with stand-ins is refused (its members would not be identical).
"""
from __future__ import annotations

import threading
from collections import deque

from . import sim_ops
import time

from .errors import CollectiveMismatchError, CollectiveTimeoutError, DeadlockError, RankAbortedError
from .instruments import Instruments
from .ledger import Ledger


class Slot:
    """One call as all its members see it."""

    __slots__ = ("n", "p2p", "calls", "arrived", "done", "error", "waiters", "where", "start", "end")

    def __init__(self, n: int, where: str, p2p: bool = False):
        self.n = n
        self.p2p = p2p
        self.calls = [None] * n
        self.arrived = 0
        self.done = False
        self.error = None  # (exception class, message)
        self.waiters = []
        self.where = where
        self.start = self.end = None  # simulated times, with a time model


def _replay_tag(call):
    """What a replayed step must repeat at this call (the simulator's record and replay): the op, its label, the
    shapes and splits; a data-dependent size (an MoE's token counts) differs and stops it."""
    e = call.entry
    return (call.op, call.label, e.dtype, e.shape, call.in_splits, call.out_splits)


class RankState:
    """Per-rank state of the simulation (kept here, never in module globals)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.wake = threading.Lock()
        self.wake.acquire()  # released exactly once per wait
        self.group_creations: dict = {}  # ranks tuple -> how many groups of them this rank made
        self.instruments = Instruments()  # what every group of this rank exposes as `group.instruments`
        self.waiting_on = None  # (Slot, Call) while blocked
        self.chain = None  # ranks this one wakes in turn once it is woken (see SimWorld._complete)
        self.finished = False


class SimWorld:
    def __init__(self, world_size: int, max_running: int | None = None, time_model=None, live=None,
                 timeout: float | None = None):
        self.size = world_size
        self.timeout = timeout  # seconds a rank may wait in one call (None: for ever)
        self.live = frozenset(live) if live is not None else None  # None: every rank runs
        self.time_model = time_model  # a collectives.timing.TimeModel: calls are timed by it
        # At most `max_running` ranks execute between blocking points; a rank gives its
        # slot back whenever it blocks in a call and takes one again when woken. Bounds
        # how many ranks hold live activations at once (memory), never causes a deadlock:
        # a rank holding a slot either returns or blocks, and both free the slot.
        self.running = threading.Semaphore(max_running) if max_running else None
        self.mutex = threading.Lock()
        self.pending: dict = {}  # (group key, seq) -> Slot
        self.channels: dict = {}  # (group key, src, dst) -> (deque of send Slots, deque of recv Slots)
        self.ranks = [RankState(r) for r in range(world_size)]
        self.alive = world_size if live is None else len(self.live)
        self.blocked = 0
        self.failure = None  # (rank, exception) of the first rank that raised
        self.deadlock = None  # the message, once detected
        self.timed_out = None  # the message, once a rank waited past the timeout
        self.stopped = threading.Event()  # set when the world stops (a failure, a deadlock, a timeout)
        self.ledger = Ledger(world_size)

    # -- posting --------------------------------------------------------------------
    def post_collective(self, key, seq: int, call) -> Slot:
        n = call.n
        with self.mutex:
            self._raise_if_aborted()
            slot = self.pending.get((key, seq))
            if slot is None:
                slot = self.pending[(key, seq)] = Slot(n, f"group {list(call.group)} call #{seq}")
            if slot.calls[call.pos] is not None:
                raise AssertionError(f"rank {call.rank} posted twice to {slot.where}")
            slot.calls[call.pos] = call
            slot.arrived += 1
            ready = slot.arrived == n
            if self.time_model is not None:
                call.ready = self.time_model.issued(call.rank, key, _replay_tag(call), alone=len(call.group) == 1)
            if ready:
                del self.pending[(key, seq)]
                if self.time_model is not None:
                    self._time(slot, key)
        if ready:
            self._complete(slot, slot.calls)
        return slot

    def post_p2p(self, key, call) -> Slot:
        src, dst = call.group
        with self.mutex:
            self._raise_if_aborted()
            sends, recvs = self.channels.setdefault((key, src, dst), (deque(), deque()))
            mine, theirs = (sends, recvs) if call.op == "send" else (recvs, sends)
            if self.time_model is not None:
                call.ready = self.time_model.issued(call.rank, (key, src, dst), _replay_tag(call))
            if theirs:
                slot = theirs.popleft()
                slot.calls[0 if call.op == "send" else 1] = call
                slot.arrived = 2
                ready = True
                if self.time_model is not None:
                    self._time(slot, (key, src, dst))
            else:
                slot = Slot(2, f"{call.op} rank {src} -> rank {dst}", p2p=True)
                slot.calls[0 if call.op == "send" else 1] = call
                slot.arrived = 1
                mine.append(slot)
                ready = False
        if ready:
            self._complete(slot, slot.calls)
        return slot

    # -- stand-ins --------------------------------------------------------------------
    def live_members(self, group: tuple) -> list:
        return list(group) if self.live is None else [r for r in group if r in self.live]

    def complete_alone(self, key, call) -> Slot:
        """The caller stands for every member of its group (see the module docstring)."""
        if not all(getattr(buf, "is_meta", False) for buf in call.bufs.values()):
            sim_ops.as_if_identical(call, len(call.group))
        slot = Slot(1, f"group {list(call.group)} (stand-ins)")
        slot.calls[0] = call
        slot.arrived = 1
        if call.op == "all_gather_object":
            call.result = [call.obj] * len(call.group)
        elif call.op == "broadcast_object":
            call.result = call.obj
        stream = (key, *call.group) if call.op in ("send", "recv") else key  # as post_p2p's channels
        with self.mutex:
            self._raise_if_aborted()
            if self.time_model is not None:
                call.ready = self.time_model.issued(call.rank, stream, _replay_tag(call), alone=len(call.group) == 1)
                self._time(slot, stream)
            slot.done = True
        return slot

    def _time(self, slot: Slot, stream) -> None:
        """Under the mutex, when the last member arrives (so the calls of one group are
        timed in their program order): the time model says when the call starts and ends,
        from the largest member's message (uneven all-to-alls differ by rank).
        The ledger records the algorithm it chose and, where it is not the ring, its bytes.
        Object collectives are timed as empty messages (their size is known only once
        pickled)."""
        calls = slot.calls
        first = calls[0]
        # uneven all-to-alls: the call lasts as long as its largest message (every member waits for it)
        size = max(c.entry.size for c in calls)
        slot.start, slot.end, algorithm, moved = self.time_model.schedule(
            first.op, size, first.group, [(c.rank, c.ready) for c in calls], stream)
        for c in calls:
            e = c.entry
            e.start, e.end = slot.start, slot.end
            if moved is not None:  # the time model chose another algorithm than the ring
                e.algorithm, (e.bytes_sent, e.bytes_recv) = algorithm, moved

    def _complete(self, slot: Slot, calls) -> None:
        try:
            msg = sim_ops.validate(calls)
            if msg:
                slot.error = (CollectiveMismatchError, msg)
            else:
                sim_ops.execute(calls)
        except Exception as exc:  # a data error (e.g. AVG of integers) fails every member
            slot.error = (type(exc), f"{exc} (in {calls[0].describe()})")
        with self.mutex:
            slot.done = True
            # the data has moved: each member's Work keeps its own call (and its tensor, as
            # NCCL's does until waited), not its peers' (a kept send would otherwise keep
            # the receiver's buffer alive on the receiver's behalf)
            slot.calls = None
            # Wake the waiters as a chain: release the first, which releases the next, ...
            # So at most two threads contend for the GIL instead of all of them (at 1024
            # ranks a bare barrier takes 26 ms this way against 40 ms waking all at once).
            chain = []
            for r in slot.waiters:
                state = self.ranks[r]
                if state.waiting_on is not None:
                    state.waiting_on = None
                    self.blocked -= 1
                    chain.append(r)
            slot.waiters.clear()
        self._release_chain(chain)

    def _release_chain(self, chain) -> None:
        if chain:
            first = self.ranks[chain.pop()]
            first.chain = chain
            first.wake.release()

    # -- waiting --------------------------------------------------------------------
    def wait(self, slot: Slot, rank: int, call) -> None:
        state = self.ranks[rank]
        with self.mutex:
            registered = not slot.done
            if registered:
                self._raise_if_aborted()
                slot.waiters.append(rank)
                state.waiting_on = (slot, call)
                self.blocked += 1
                if self.blocked == self.alive:
                    self._declare_deadlock()  # wakes every blocked rank, this one too
        if registered:
            if self.running is not None:
                self.running.release()
            if not state.wake.acquire(timeout=self.timeout if self.timeout is not None else -1):
                with self.mutex:
                    if state.waiting_on is not None and self.timed_out is None and self.deadlock is None:
                        self._declare_timeout(rank)
                state.wake.acquire()  # (released by the completion or by the stop, whichever came)
            chain, state.chain = state.chain, None
            self._release_chain(chain)
            if self.running is not None:
                self.running.acquire()
            if not slot.done:
                with self.mutex:
                    self._raise_if_aborted()
                raise AssertionError("woken before completion without a reason")
        if slot.error is not None:
            cls, msg = slot.error
            raise cls(msg)
        if slot.end is not None:
            self.time_model.waited(rank, slot.start, slot.end, call.label, alone=len(call.group) == 1)

    def _wake(self, rank: int) -> None:
        """Under the mutex: release a blocked rank (once)."""
        state = self.ranks[rank]
        if state.waiting_on is not None:
            state.waiting_on = None
            self.blocked -= 1
            state.wake.release()

    def _wake_all(self) -> None:
        self.stopped.set()
        for r in range(self.size):
            self._wake(r)

    def stall(self, rank: int) -> None:
        """The rank stops answering (an injected hang): it runs no call until the world
        stops for another reason (a timeout, another rank's failure), then it is aborted."""
        self.stopped.wait()
        with self.mutex:
            self._raise_if_aborted()
        raise RankAbortedError(f"rank {rank} hung and was stopped")

    def _raise_if_aborted(self) -> None:
        if self.deadlock is not None:
            raise DeadlockError(self.deadlock)
        if self.timed_out is not None:
            raise CollectiveTimeoutError(self.timed_out)
        if self.failure is not None:
            r, exc = self.failure
            raise RankAbortedError(f"stopped because rank {r} failed: {type(exc).__name__}: {exc}")

    def _declare_deadlock(self) -> None:
        lines = ["deadlock: every live rank is blocked and none can make progress"]
        for st in self.ranks:
            if st.finished:
                lines.append(f"  rank {st.rank}: has returned")
            elif st.waiting_on is not None:
                slot, call = st.waiting_on
                what = call.describe()
                if slot.p2p:
                    lines.append(f"  rank {st.rank}: waits in {what} ({slot.where}: the peer never posted the matching call)")
                else:
                    members = next(c for c in slot.calls if c is not None).group
                    missing = [members[i] for i, c in enumerate(slot.calls) if c is None]
                    lines.append(f"  rank {st.rank}: waits in {what} ({slot.where}; "
                                 f"ranks {missing} never arrived)")
        self.deadlock = "\n".join(lines)
        self._wake_all()

    def _declare_timeout(self, rank: int) -> None:
        """Under the mutex: `rank` waited in its call past the timeout; stop every rank."""
        slot, call = self.ranks[rank].waiting_on
        lines = [f"timeout: rank {rank} waited {self.timeout:g} s in {call.describe()} ({slot.where})"]
        for st in self.ranks:
            if st.finished:
                lines.append(f"  rank {st.rank}: has returned")
            elif st.waiting_on is not None:
                s, c = st.waiting_on
                members = next(x for x in s.calls if x is not None).group
                missing = [members[i] for i, x in enumerate(s.calls) if x is None]
                lines.append(f"  rank {st.rank}: waits in {c.describe()} ({s.where}"
                             + (f"; ranks {missing} never arrived)" if missing and not s.p2p else ")"))
            elif self.live is None or st.rank in self.live:
                lines.append(f"  rank {st.rank}: in no call (hung, or still computing)")
        self.timed_out = "\n".join(lines)
        self._wake_all()

    # -- rank lifecycle ------------------------------------------------------------------
    def rank_finished(self, rank: int, exc: BaseException | None) -> None:
        with self.mutex:
            self.ranks[rank].finished = True
            self.alive -= 1
            if exc is not None:
                if self.failure is None and not isinstance(exc, RankAbortedError):
                    self.failure = (rank, exc)
                self._wake_all()
            elif self.alive and self.blocked == self.alive and self.deadlock is None:
                self._declare_deadlock()
