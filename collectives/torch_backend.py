"""The torch backend: the same `ProcessGroup` API over torch.distributed (NCCL on CUDA,
gloo on CPU). Ledger entries come from the same formulas as on the simulated backend;
their start and end are measured in seconds since the launch. On CPUs: the host clock
(gloo's wait blocks the host until the transfer is done). On CUDA, waiting a call only
orders the current stream after it (torch's own semantics), and its start and end are CUDA
events recorded on the current stream when it is issued and when it is waited, turned
into seconds after the run (`DeviceTimes.resolve`); so the host may run ahead of the
device, by at most `max_in_flight` waited calls whose transfers have not finished: each
holds its buffers until NCCL is done with them, and an unbounded run-ahead grew memory up
to 4× (benchmarks/results/gpu/run0_first/summary.md)."""
from __future__ import annotations

import collections
import datetime
import pickle
import time
import warnings

import torch
import torch.distributed as dist

from .errors import CollectiveTimeoutError
from .instruments import Instruments
from .ledger import Ledger
from .process_group import ProcessGroup, Work
from .reduce_op import ReduceOp

_DIST_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


class DeviceTimes:
    """The CUDA events of every call's start and end, resolved into seconds since the
    launch after the run, and the bound on how far the host runs ahead of the device."""

    def __init__(self, origin: float, max_in_flight: int = 2):
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()
        self.origin.synchronize()
        self.offset = time.perf_counter() - origin  # the origin event, in seconds since the launch
        self.max_in_flight = max_in_flight
        # (ledger entries, start event, end event): the entries only, not the calls, which hold
        # the buffers (keeping them to the end of the run kept every collective's tensors alive)
        self.pending: list = []
        self.in_flight: collections.deque = collections.deque()  # end events not yet known complete
        self.blocked = 0.0  # seconds the host has waited here for the device (the run-ahead bound)

    @staticmethod
    def event():
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ended(self, calls, start) -> None:
        end = self.event()
        self.pending.append(([c.entry for c in calls], start, end))
        self.in_flight.append(end)
        if len(self.in_flight) > self.max_in_flight:
            t0 = time.perf_counter()
            while len(self.in_flight) > self.max_in_flight:
                self.in_flight.popleft().synchronize()
            self.blocked += time.perf_counter() - t0

    def resolve(self) -> None:
        """Fill the start and end of every call waited so far (synchronises the device)."""
        torch.cuda.synchronize()
        for entries, start, end in self.pending:
            for e in entries:
                e.start = self.offset + self.origin.elapsed_time(start) / 1e3
                e.end = self.offset + self.origin.elapsed_time(end) / 1e3
        self.pending.clear()
        self.in_flight.clear()


class TorchWork(Work):
    def __init__(self, works, calls, origin: float, device_times: DeviceTimes | None, start_event=None,
                 timeout: float | None = None):
        self._works, self._calls, self._origin = works, calls, origin
        self._times, self._start = device_times, start_event
        self._timeout = timeout  # seconds the host may wait for a call on the CPU (gloo's async ops wait for ever)
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            for w in self._works:
                if w is None:
                    continue
                if self._times is not None or not self._timeout:
                    w.wait()  # NCCL: the current stream waits for the transfer, not the host
                    continue
                try:
                    w.wait(datetime.timedelta(seconds=self._timeout))
                except RuntimeError as e:
                    if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                        raise
                    c = self._calls[0]
                    raise CollectiveTimeoutError(f"timeout: rank {c.rank} waited {self._timeout:g} s in {c.describe()}: "
                                                 f"a peer never arrived ({str(e).splitlines()[0]})") from None
            if self._times is not None:
                self._times.ended(self._calls, self._start)
            else:
                end = time.perf_counter() - self._origin
                for c in self._calls:
                    c.entry.end = end
            for c in self._calls:
                _finish_object(c)
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or all(w is None or w.is_completed() for w in self._works)


def _finish_object(call) -> None:
    if call.op == "broadcast_object":
        call.result = call.obj[0]
        call.set_object_size(len(pickle.dumps(call.result)))
    elif call.op == "all_gather_object":
        call.result = call.obj
        call.set_object_size(len(call.obj) * max(len(pickle.dumps(o)) for o in call.obj))


class _Joined:
    """Several torch works waited as one."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


class TorchProcessGroup(ProcessGroup):
    _zero_copy_views = False
    timing = None  # time is measured here, not simulated

    def __init__(self, pg, ranks, ledger: Ledger, origin: float, device_times: DeviceTimes | None = None,
                 instruments: Instruments | None = None, timeout: float | None = None):
        """`device_times`: on CUDA, where the calls' events go (one for the whole world);
        `instruments`: this process's (its groups share the world's); `timeout`: seconds the
        host waits for a call on the CPU before CollectiveTimeoutError."""
        self._timeout = timeout
        self.instruments = instruments if instruments is not None else Instruments()
        self._pg = pg  # torch group handle (None: the default group)
        self.ranks = tuple(ranks)
        self.rank = self.ranks.index(dist.get_rank())
        self.size = len(self.ranks)
        self._ledger = ledger
        self._origin = origin
        self._times = device_times

    def _record(self, call) -> None:
        lst = self._ledger.per_rank[call.rank]
        lst.append(call.make_entry(len(lst)))

    def _cuda(self, call) -> bool:
        return any(b is not None and b.device == "cuda" for b in call.bufs.values())

    def _timing(self, calls):
        """(device times, start event) for calls on CUDA tensors; else (None, None), the
        start taken on the host clock."""
        if self._times is not None and any(self._cuda(c) for c in calls):
            return self._times, self._times.event()
        start = time.perf_counter() - self._origin
        for c in calls:
            c.entry.start = start
        return None, None

    def _issue(self, call) -> Work:
        if self.size == 1 and call.op not in ("send", "recv"):
            return self._alone(call)
        times, start = self._timing([call])
        work = self._start(call)
        return TorchWork([work], [call], self._origin, times, start, self._timeout)

    def _alone(self, call) -> Work:
        """A collective over this rank alone, done here and complete at once: its result is its
        input (a reduction or a broadcast leaves the tensor as it is; a gather, scatter or
        exchange copies its input into its output). NCCL would launch a copy and a kernel for
        that identity, behind a host path longer than the device's work, and the run-ahead
        bound (`DeviceTimes`) would stop the host at every third call: on one GPU, once per
        data-parallel bucket at the end of every backward (benchmarks/results/gpu/run53_moe_gaps)."""
        t = {k: (b.obj if b is not None else None) for k, b in call.bufs.items()}
        call.entry.start = time.perf_counter() - self._origin
        if call.op in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
            out, inp = t["out"], t["inp"]
            if out.data_ptr() != inp.data_ptr():
                out.view(-1).copy_(inp.reshape(-1))
        elif call.op in ("broadcast_object", "all_gather_object"):
            call.obj = [call.obj]
        return TorchWork([None], [call], self._origin, None, None, self._timeout)

    def _issue_batch(self, calls) -> list:
        if not calls:
            return []
        times, start = self._timing(calls)
        ops = [dist.P2POp(dist.isend if c.op == "send" else dist.irecv, c.bufs["tensor"].obj,
                          self.ranks[c.root], self._pg) for c in calls]
        works = dist.batch_isend_irecv(ops)
        shared = TorchWork(works, calls, self._origin, times, start, self._timeout)
        return [shared] * len(calls)

    def host_blocked(self) -> float:
        return self._times.blocked if self._times is not None else 0.0

    def resolve_times(self) -> None:
        """Give every call waited so far its measured start and end (CUDA: read the events)."""
        if self._times is not None:
            self._times.resolve()

    def _start(self, call):
        g, op = self._pg, call.op
        t = {k: (b.obj if b is not None else None) for k, b in call.bufs.items()}
        rop = _DIST_OP.get(call.reduce_op)
        root = None if call.root is None else self.ranks[call.root]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename in 2.13
            if op == "all_reduce":
                return dist.all_reduce(t["tensor"], op=rop, group=g, async_op=True)
            if op == "reduce":
                return dist.reduce(t["tensor"], dst=root, op=rop, group=g, async_op=True)
            if op == "broadcast":
                return dist.broadcast(t["tensor"], src=root, group=g, async_op=True)
            if op == "all_gather":
                return dist.all_gather_into_tensor(t["out"].view(-1), t["inp"].reshape(-1), group=g, async_op=True)
            if op == "reduce_scatter":
                return dist.reduce_scatter_tensor(t["out"].view(-1), t["inp"].view(-1), op=rop, group=g, async_op=True)
            if op == "all_to_all":
                if g is not None and dist.get_backend(g) == "gloo":
                    return self._all_to_all_p2p(call, t["out"], t["inp"])
                return dist.all_to_all_single(t["out"], t["inp"], list(call.out_splits), list(call.in_splits),
                                              group=g, async_op=True)
            if op == "scatter":
                chunks = None
                if call.pos == call.root:
                    chunks = list(t["inp"].view(self.size, -1).unbind(0))
                    chunks = [c.view(t["out"].shape) for c in chunks]
                return dist.scatter(t["out"], chunks, src=root, group=g, async_op=True)
            if op == "gather":
                chunks = None
                if call.pos == call.root:
                    chunks = [c.view(t["inp"].shape) for c in t["out"].view(self.size, -1).unbind(0)]
                return dist.gather(t["inp"].contiguous(), chunks, dst=root, group=g, async_op=True)
            if op == "send":
                return dist.isend(t["tensor"], dst=root, group=g)
            if op == "recv":
                return dist.irecv(t["tensor"], src=root, group=g)
            if op == "barrier":
                return dist.barrier(group=g, async_op=True)
            if op == "broadcast_object":
                box = [call.obj]
                dist.broadcast_object_list(box, src=root, group=g)
                call.obj = box
                return None
            if op == "all_gather_object":
                out = [None] * self.size
                dist.all_gather_object(out, call.obj, group=g)
                call.obj = out
                return None
        raise ValueError(f"unknown op {op!r}")

    def _all_to_all_p2p(self, call, out, inp):
        """Gloo's alltoallv checks a sub-group rank's own chunk lengths at its *global*
        index (torch 2.13), so on gloo sub-groups the exchange is done point to point."""
        outs = list(out.split(list(call.out_splits)))
        ins = list(inp.split(list(call.in_splits)))
        outs[self.rank].copy_(ins[self.rank])
        ops = []
        for j in range(self.size):
            if j != self.rank:
                ops.append(dist.P2POp(dist.isend, ins[j].contiguous(), self.ranks[j], self._pg))
                ops.append(dist.P2POp(dist.irecv, outs[j], self.ranks[j], self._pg))
        works = dist.batch_isend_irecv(ops) if ops else []
        return _Joined(works)

    def new_group(self, ranks):
        members = self._members(ranks)
        pg = dist.new_group(members)
        if dist.get_rank() not in members:
            return None
        return TorchProcessGroup(pg, members, self._ledger, self._origin, self._times, self.instruments, self._timeout)
