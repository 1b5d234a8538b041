"""One rank's side of one collective or point-to-point call, as both backends see it.

The API layer (`process_group.ProcessGroup`) turns a method call into a `Call`: the
buffers, the root, the reduce op, the splits, the label, the caller's file:line, and its
ledger entry with the message size and the bytes this rank moves. The backends only
execute calls; so the ledger is the same formulas on every backend.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from .algorithms import algorithm_of, ring_bytes
from .ledger import LedgerEntry
from .reduce_op import ReduceOp


class Site:
    """file:line of a call, formatted only when a message or the ledger needs it."""

    __slots__ = ("filename", "lineno")

    def __init__(self, filename: str, lineno: int):
        self.filename, self.lineno = filename, lineno

    def __str__(self) -> str:
        return f"{os.path.basename(self.filename)}:{self.lineno}"

    __repr__ = __str__


def caller_site() -> Site:
    """The site of the user's call: every public ProcessGroup method calls this directly,
    so the user's frame is two up (caller_site <- the method <- the user)."""
    f = sys._getframe(2)
    return Site(f.f_code.co_filename, f.f_lineno)


@dataclass(eq=False, slots=True)
class Call:
    op: str
    pos: int  # rank within the group
    rank: int  # global rank
    group: tuple  # global ranks of the group (src, dst for p2p)
    label: str
    site: Site
    bufs: dict = field(default_factory=dict)  # "tensor" | "inp" | "out" -> Buffer
    root: int | None = None  # group-local src/dst for rooted ops; peer for p2p
    reduce_op: ReduceOp | None = None
    out_splits: tuple | None = None
    in_splits: tuple | None = None
    obj: object = None  # payload of the object collectives
    result: object = None  # what the object collectives return
    entry: LedgerEntry | None = None
    ready: float = 0.0  # simulated time the call can start on this rank (with a time model)

    def signature(self) -> tuple:
        """What every member of a collective must agree on, as one comparable tuple
        (all_to_all splits are checked across ranks separately)."""
        op, b = self.op, self.bufs
        if op in ("all_reduce", "broadcast", "reduce"):
            t = b["tensor"]
            data = (t.shape, t.dtype, t.is_meta)
        elif op in ("all_gather", "reduce_scatter"):
            data = (b["inp"].numel, b["out"].numel, b["inp"].dtype, b["inp"].is_meta)
        elif op in ("scatter", "gather"):
            t = b["out"] if op == "scatter" else b["inp"]  # the buffer every rank passes
            data = (t.numel, t.dtype, t.is_meta)
        elif op == "all_to_all":
            data = (b["inp"].shape[1:], b["inp"].dtype, b["inp"].is_meta)
        else:
            data = ()
        return (op, self.label, self.root, self.reduce_op, data)

    @property
    def n(self) -> int:
        return len(self.group)

    @property
    def is_meta(self) -> bool:
        return any(b.is_meta for b in self.bufs.values() if b is not None)

    def describe(self) -> str:
        parts = []
        for name, b in self.bufs.items():
            if b is not None:
                parts.append(f"{name}={list(b.shape)}")
        dtypes = sorted({b.dtype for b in self.bufs.values() if b is not None})
        if dtypes:
            parts.append(f"dtype={'/'.join(dtypes)}")
        if self.root is not None:
            parts.append(("peer=" if self.op in ("send", "recv") else "root=") + str(self.root))
        if self.reduce_op is not None:
            parts.append(f"op={self.reduce_op.name}")
        if self.in_splits is not None or self.out_splits is not None:
            parts.append(f"in_splits={self.in_splits} out_splits={self.out_splits}")
        parts.append(f"label={self.label!r}")
        return f"{self.op}({', '.join(parts)}) at {self.site}"

    # -- ledger ---------------------------------------------------------------------
    def make_entry(self, index: int) -> LedgerEntry:
        size, sent, recv = self._bytes()
        main = self.bufs.get("tensor") or self.bufs.get("inp") or self.bufs.get("out")
        self.entry = LedgerEntry(
            rank=self.rank,
            index=index,
            op=self.op,
            group=self.group,
            label=self.label,
            dtype=main.dtype if main is not None else ("pickle" if "object" in self.op else ""),
            shape=main.shape if main is not None else (),
            size=size,
            algorithm=algorithm_of(self.op),
            bytes_sent=sent,
            bytes_recv=recv,
            site=self.site,
        )
        return self.entry

    def _bytes(self) -> tuple[int, int, int]:
        n, op = self.n, self.op
        b = self.bufs
        if op in ("send", "recv"):
            s = b["tensor"].nbytes
            return s, (s if op == "send" else 0), (s if op == "recv" else 0)
        if op in ("all_reduce", "broadcast", "reduce"):
            size = b["tensor"].nbytes
        elif op == "all_gather":
            size = b["out"].nbytes
        elif op == "reduce_scatter":
            size = b["inp"].nbytes
        elif op == "all_to_all":
            size = b["inp"].nbytes
            row_in = b["inp"].nbytes // max(b["inp"].shape[0], 1) if b["inp"].shape else 0
            row_out = b["out"].nbytes // max(b["out"].shape[0], 1) if b["out"].shape else 0
            sent = sum(s for j, s in enumerate(self.in_splits) if j != self.pos) * row_in
            recv = sum(s for j, s in enumerate(self.out_splits) if j != self.pos) * row_out
            return size, (sent if n > 1 else 0), (recv if n > 1 else 0)
        elif op == "scatter":
            size = n * b["out"].nbytes
        elif op == "gather":
            size = n * b["inp"].nbytes
        elif op in ("barrier", "broadcast_object", "all_gather_object"):
            size = 0  # object sizes are set once the payload is known (set_object_size)
        else:
            raise ValueError(f"unknown op {op!r}")
        sent, recv = ring_bytes(op, size, n, self.pos, self.root or 0)
        return size, sent, recv

    def set_object_size(self, size: int) -> None:
        """Object collectives know their message size only once pickled."""
        e = self.entry
        e.size = size
        e.bytes_sent, e.bytes_recv = ring_bytes(self.op, size, self.n, self.pos, self.root or 0)
