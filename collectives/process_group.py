"""The `ProcessGroup` API (docs/architecture.md, Contract 1), shared by both backends.

Same names and in-place semantics as torch.distributed, but methods on the group, and
every rank argument is a rank *within the group*. Each method checks its own arguments,
builds a `Call` (which carries the ledger entry) and hands it to the backend's `_issue`,
which returns a `Work`. With `async_op=False` the method waits and returns None (the
object collectives return their object).
"""
from __future__ import annotations

import abc
import time

from .buffers import as_buffer
from .call import Call, caller_site
from .reduce_op import ReduceOp


class Work(abc.ABC):
    """Handle of an asynchronous call: `wait()` blocks until its result is in place."""

    @abc.abstractmethod
    def wait(self) -> bool: ...

    @abc.abstractmethod
    def is_completed(self) -> bool: ...


class P2POp:
    """One point-to-point operation for `batch_isend_irecv`: `op` is "isend"/"irecv"
    (or the group's bound `isend` / `irecv` method), `peer` a rank within the group."""

    def __init__(self, op, tensor, peer: int, label: str | None = None):
        name = op if isinstance(op, str) else getattr(op, "__name__", str(op))
        if name not in ("isend", "irecv", "send", "recv"):
            raise ValueError(f"P2POp op must be isend or irecv, got {op!r}")
        self.op = "send" if name in ("isend", "send") else "recv"
        self.tensor = tensor
        self.peer = peer
        self.label = label


def _check_rank(what: str, r: int, size: int) -> None:
    if not isinstance(r, int) or not 0 <= r < size:
        raise ValueError(f"{what}={r!r} is not a rank of this group (group ranks are 0..{size - 1})")


def _check_contiguous(name, t) -> None:
    ok = t.is_contiguous() if hasattr(t, "is_contiguous") else (t.flags["C_CONTIGUOUS"])
    if not ok:
        raise ValueError(f"{name} must be contiguous (shape {tuple(t.shape)})")


class ProcessGroup(abc.ABC):
    """A group of ranks. `rank` and `size` are within the group; `ranks` the global ranks."""

    rank: int
    size: int
    ranks: tuple
    timing = None  # a time model's view of this rank (collectives.timing), on the simulated backend
    instruments = None  # this rank's Instruments (collectives/instruments.py), shared by all its groups

    # -- backend hooks ---------------------------------------------------------------
    @abc.abstractmethod
    def _issue(self, call: Call) -> Work:
        """Start `call`; return its Work."""

    @abc.abstractmethod
    def _record(self, call: Call) -> None:
        """Give `call` its ledger entry (index = this rank's call count) and store it."""

    @abc.abstractmethod
    def new_group(self, ranks) -> "ProcessGroup | None":
        """A sub-group of this group's ranks (group-local numbers; group ranks follow
        ascending global rank, as in torch). Like torch, every rank of this group must
        call it, in the same order; non-members get None."""

    def stall(self) -> None:
        """Stop answering (an injected hang): issue no call again. The other ranks' collective
        timeout finds it; then the launcher (or torchrun) stops this process."""
        while True:
            time.sleep(3600)

    def host_blocked(self) -> float:
        """Seconds this rank's host has waited for its device so far in the backend's bound on
        how far it runs ahead (the torch backend on CUDA); 0 elsewhere. Per step, the rest of
        the step's wall time is the host's own work: a step whose host never waits is
        host-bound."""
        return 0.0

    # -- helpers -----------------------------------------------------------------------
    _zero_copy_views = True  # the simulated backend computes on NumPy views

    def _buffer(self, t, what: str = "tensor"):
        return as_buffer(t, what, view=self._zero_copy_views)

    def _concatenation(self, op, name, t, part_name, part, root=None):
        """The buffer `name` that holds `size` parts like `part` concatenated along dim 0
        (all_gather's and gather's out, reduce_scatter's and scatter's inp), checked."""
        if t is None:
            raise ValueError(f"{op}: {name} is required on the {'source' if op == 'scatter' else 'destination'} "
                             f"rank {root}")
        b = self._buffer(t, name)
        _check_contiguous(name, t)
        if b.numel != self.size * part.numel or b.dtype != part.dtype:
            raise ValueError(
                f"{op}: {name} must hold {self.size} × {part_name} ({self.size} × {part.numel} {part.dtype} elements), "
                f"got {b.numel} {b.dtype} elements ({name} shape {list(b.shape)}, {part_name} shape {list(part.shape)})")
        return b

    def _dense(self, t, name: str = "tensor"):
        """`t`'s buffer, refused unless contiguous: NCCL refuses a strided tensor, and gloo's
        all_reduce and broadcast take its first numel elements of storage (a silent wrong
        answer), so the simulated backend refuses it too."""
        b = self._buffer(t, name)
        _check_contiguous(name, t)
        return b

    def _issue_batch(self, calls) -> list:
        """Start point-to-point calls together (torch overrides: NCCL needs one batch)."""
        return [self._issue(c) for c in calls]

    def _members(self, ranks) -> tuple:
        """Global ranks of a new sub-group given by group-local `ranks`, checked, in
        ascending order: torch.distributed sorts them, so group rank i is the i-th
        smallest global rank on every backend."""
        ranks = [int(r) for r in ranks]
        if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < self.size for r in ranks):
            raise ValueError(f"new_group: ranks {ranks} must be distinct ranks of this group (0..{self.size - 1})")
        return tuple(sorted(self.ranks[r] for r in ranks))

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, ranks={list(self.ranks)})"

    def _run(self, call: Call, async_op: bool):
        self._record(call)
        work = self._issue(call)
        if async_op:
            return work
        work.wait()
        return None

    def _call(self, op, label, site, **kw) -> Call:
        return Call(op=op, pos=self.rank, rank=self.ranks[self.rank], group=tuple(self.ranks),
                    label=label or op, site=site, **kw)

    # -- collectives ------------------------------------------------------------------
    def all_reduce(self, tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False, label: str | None = None):
        call = self._call("all_reduce", label, caller_site(), bufs={"tensor": self._dense(tensor)}, reduce_op=op)
        return self._run(call, async_op)

    def reduce(self, tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM, async_op: bool = False, label: str | None = None):
        _check_rank("dst", dst, self.size)
        call = self._call("reduce", label, caller_site(), bufs={"tensor": self._dense(tensor)}, root=dst, reduce_op=op)
        return self._run(call, async_op)

    def broadcast(self, tensor, src: int = 0, async_op: bool = False, label: str | None = None):
        _check_rank("src", src, self.size)
        call = self._call("broadcast", label, caller_site(), bufs={"tensor": self._dense(tensor)}, root=src)
        return self._run(call, async_op)

    def all_gather(self, out, inp, async_op: bool = False, label: str | None = None):
        """out = concatenation of every rank's inp along dim 0 (group-rank order)."""
        i = self._buffer(inp, "inp")
        o = self._concatenation("all_gather", "out", out, "inp", i)
        call = self._call("all_gather", label, caller_site(), bufs={"out": o, "inp": i})
        return self._run(call, async_op)

    def reduce_scatter(self, out, inp, op: ReduceOp = ReduceOp.SUM, async_op: bool = False, label: str | None = None):
        """inp is the concatenation along dim 0 of `size` chunks; rank r gets the reduction of chunk r."""
        o = self._buffer(out, "out")
        _check_contiguous("out", out)
        i = self._concatenation("reduce_scatter", "inp", inp, "out", o)
        call = self._call("reduce_scatter", label, caller_site(), bufs={"out": o, "inp": i}, reduce_op=op)
        return self._run(call, async_op)

    def all_to_all(self, out, inp, out_splits=None, in_splits=None, async_op: bool = False, label: str | None = None):
        """Rank r sends rows [sum(in_splits[:j]), +in_splits[j]) of inp to rank j and
        receives rank j's chunk into rows [sum(out_splits[:j]), +out_splits[j]) of out.
        Splits count rows along dim 0; None means equal splits."""
        o, i = self._buffer(out, "out"), self._buffer(inp, "inp")
        _check_contiguous("inp", inp)
        _check_contiguous("out", out)
        if o.dtype != i.dtype or tuple(o.shape[1:]) != tuple(i.shape[1:]) or not o.shape:
            raise ValueError(f"all_to_all: out {list(o.shape)} {o.dtype} and inp {list(i.shape)} {i.dtype} "
                             "must share dtype and every dim but the first")
        in_splits = self._splits("in_splits", in_splits, i.shape[0])
        out_splits = self._splits("out_splits", out_splits, o.shape[0])
        call = self._call("all_to_all", label, caller_site(), bufs={"out": o, "inp": i},
                          out_splits=out_splits, in_splits=in_splits)
        return self._run(call, async_op)

    def _splits(self, name, splits, rows):
        if splits is None:
            if rows % self.size:
                raise ValueError(f"all_to_all: {name} not given and dim 0 ({rows}) is not divisible by the group size {self.size}")
            return (rows // self.size,) * self.size
        splits = tuple(int(s) for s in splits)
        if len(splits) != self.size or sum(splits) != rows or min(splits) < 0:
            raise ValueError(f"all_to_all: {name}={list(splits)} must have {self.size} non-negative entries summing to dim 0 = {rows}")
        return splits

    def scatter(self, out, inp=None, src: int = 0, async_op: bool = False, label: str | None = None):
        """On src, inp is the concatenation along dim 0 of `size` chunks; rank r receives chunk r into out."""
        _check_rank("src", src, self.size)
        o = self._buffer(out, "out")
        i = self._concatenation("scatter", "inp", inp, "out", o, root=src) if self.rank == src else None
        call = self._call("scatter", label, caller_site(), bufs={"out": o, "inp": i}, root=src)
        return self._run(call, async_op)

    def gather(self, out, inp, dst: int = 0, async_op: bool = False, label: str | None = None):
        """On dst, out = concatenation of every rank's inp along dim 0; out may be None elsewhere."""
        _check_rank("dst", dst, self.size)
        i = self._buffer(inp, "inp")
        o = self._concatenation("gather", "out", out, "inp", i, root=dst) if self.rank == dst else None
        call = self._call("gather", label, caller_site(), bufs={"out": o, "inp": i}, root=dst)
        return self._run(call, async_op)

    def barrier(self, label: str | None = None):
        return self._run(self._call("barrier", label, caller_site()), False)

    def broadcast_object(self, obj, src: int = 0, label: str | None = None):
        """Returns src's `obj` on every rank (pickled: other ranks get a copy)."""
        _check_rank("src", src, self.size)
        call = self._call("broadcast_object", label, caller_site(), root=src, obj=obj)
        self._run(call, False)
        return call.result

    def all_gather_object(self, obj, label: str | None = None) -> list:
        """Returns the list of every rank's `obj`, group-rank order."""
        call = self._call("all_gather_object", label, caller_site(), obj=obj)
        self._run(call, False)
        return call.result

    # -- point to point ---------------------------------------------------------------
    def _p2p(self, kind, tensor, peer, label, site) -> Call:
        _check_rank("dst" if kind == "send" else "src", peer, self.size)
        if peer == self.rank:
            raise ValueError(f"{kind}: rank {self.rank} cannot {kind} {'to' if kind == 'send' else 'from'} itself")
        me, other = self.ranks[self.rank], self.ranks[peer]
        pair = (me, other) if kind == "send" else (other, me)
        return Call(op=kind, pos=self.rank, rank=me, group=pair, label=label or kind, site=site,
                    bufs={"tensor": self._dense(tensor)}, root=peer)

    def send(self, tensor, dst: int, label: str | None = None):
        return self._run(self._p2p("send", tensor, dst, label, caller_site()), False)

    def recv(self, tensor, src: int, label: str | None = None):
        return self._run(self._p2p("recv", tensor, src, label, caller_site()), False)

    def isend(self, tensor, dst: int, label: str | None = None) -> Work:
        return self._run(self._p2p("send", tensor, dst, label, caller_site()), True)

    def irecv(self, tensor, src: int, label: str | None = None) -> Work:
        return self._run(self._p2p("recv", tensor, src, label, caller_site()), True)

    def batch_isend_irecv(self, ops) -> list:
        """Start every op of `ops` (P2POp) at once; returns their Works."""
        site = caller_site()
        calls = [self._p2p(p.op, p.tensor, p.peer, p.label, site) for p in ops]
        for c in calls:
            self._record(c)
        return self._issue_batch(calls)
