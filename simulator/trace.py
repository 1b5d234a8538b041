"""Chrome / Perfetto trace of simulated time (chrome://tracing, ui.perfetto.dev).

One process per rank with two threads: the compute stream, as the clock's timeline spent it
(simulator/clock.py): each kernel named by its op (`mm`, `flash_attention`, `_fused_adamw`;
category "compute"), and each stall named for what it is, "waiting for the host" (category
"host"), "idle: waiting for peers" ("idle"), "pipeline bubble" ("bubble") and "exposed
communication" ("exposed"); and the communication stream (every call of the ledger over its
simulated [start, end], named by its label, with op, group, bytes and algorithm as
arguments). Times are microseconds.
"""
from __future__ import annotations

import json
import os

COMPUTE, COMM = 0, 1
STALLS = {"host": "waiting for the host", "idle": "idle: waiting for peers", "bubble": "pipeline bubble",
          "exposed": "exposed communication"}


def chrome_trace(ledger, clocks, ranks=None) -> dict:
    """The trace of a simulated run: `ledger` with start/end set (a hardware profile was
    given) and every rank's RankClock; only `ranks` if given (a plan's stand-ins)."""
    events = []
    for rank, clock in enumerate(clocks):
        if ranks is not None and rank not in ranks:
            continue
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMPUTE, "args": {"name": "compute"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMM, "args": {"name": "communication"}})
        for kind, name, start, end in clock.events:
            events.append({"ph": "X", "name": name if kind == "compute" else STALLS[kind], "cat": kind, "pid": rank,
                           "tid": COMPUTE, "ts": start * 1e6, "dur": (end - start) * 1e6})
        for e in ledger.for_rank(rank):
            if e.start is None:
                raise ValueError("the ledger has no simulated times: launch with a hardware profile")
            events.append({"ph": "X", "name": e.label, "cat": e.op, "pid": rank, "tid": COMM,
                           "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                           "args": {"op": e.op, "group": list(e.group), "bytes": e.size, "sent": e.bytes_sent,
                                    "received": e.bytes_recv, "dtype": e.dtype, "site": str(e.site)}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def write_chrome_trace(path: str, ledger, clocks, ranks=None) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace(ledger, clocks, None if ranks is None else set(ranks)), f)
