"""Data movement of the simulated backend: each collective computed with NumPy once every
member has arrived.

`validate(calls)` compares what the members of one call asked for and returns a message
naming each rank's call if they disagree. `execute(calls)` moves the data: every output
is written from the inputs of all ranks; reductions go through `reduce_op.reduce_arrays`
in group-rank order. Inputs that may share memory with their own rank's output are copied
first, so in-place variants (an all_gather whose inp is a slice of out) are safe.
Meta buffers move nothing.
"""
from __future__ import annotations

import pickle

import numpy as np

from .errors import CollectiveMismatchError
from .reduce_op import ReduceOp, reduce_arrays


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _mismatch(calls, why: str) -> str:
    lines = [f"ranks of group {list(calls[0].group)} disagree at the same call ({why}):"]
    for c in calls:
        lines.append(f"  rank {c.rank} (group rank {c.pos}): {c.describe()}")
    return "\n".join(lines)


def _same(calls, key, why):
    vals = [key(c) for c in calls]
    return None if all(v == vals[0] for v in vals) else _mismatch(calls, why)


def validate(calls) -> str | None:
    """None if the calls of all members agree; else a message naming every rank's call.
    For point to point, `calls` is [send, recv]."""
    if len(calls) == 1:
        return None  # no peer to disagree with
    if calls[0].op != "send":
        first = calls[0].signature()
        if all(c.signature() == first for c in calls[1:]):
            return _check_splits(calls) if first[0] == "all_to_all" else None
    if calls[0].op == "send":
        s, r = calls
        if s.bufs["tensor"].dtype != r.bufs["tensor"].dtype or s.bufs["tensor"].numel != r.bufs["tensor"].numel:
            return _mismatch(calls, "send and recv buffers differ in size or dtype")
        if s.is_meta != r.is_meta:
            return _mismatch(calls, "meta and real tensors mixed")
        return None
    checks = [
        (lambda c: c.op, "different operations"),
        (lambda c: c.label, "different labels"),
        (lambda c: c.root, "different roots"),
        (lambda c: c.reduce_op, "different reduce ops"),
        (lambda c: c.is_meta, "meta and real tensors mixed"),
    ]
    for key, why in checks:
        msg = _same(calls, key, why)
        if msg:
            return msg
    op = calls[0].op
    dtypes = lambda c: tuple(b.dtype for b in c.bufs.values() if b is not None)[:1]  # noqa: E731
    msg = _same(calls, dtypes, "different dtypes")
    if msg:
        return msg
    if op in ("all_reduce", "broadcast", "reduce"):
        return _same(calls, lambda c: c.bufs["tensor"].shape, "different shapes")
    if op in ("all_gather", "reduce_scatter"):
        return _same(calls, lambda c: (c.bufs["inp"].numel, c.bufs["out"].numel), "different sizes")
    if op == "scatter":
        return _same(calls, lambda c: c.bufs["out"].numel, "different sizes")
    if op == "gather":
        return _same(calls, lambda c: c.bufs["inp"].numel, "different sizes")
    if op == "all_to_all":
        return _same(calls, lambda c: c.bufs["inp"].shape[1:], "different trailing dims") or _check_splits(calls)
    return _mismatch(calls, "different arguments")


def _check_splits(calls) -> str | None:
    for i, c in enumerate(calls):
        for j, d in enumerate(calls):
            if c.in_splits[j] != d.out_splits[i]:
                return _mismatch(calls, f"group rank {i} sends {c.in_splits[j]} rows to group rank {j}, "
                                        f"which expects {d.out_splits[i]}")
    return None


def execute(calls) -> None:
    op = calls[0].op
    if op == "barrier" or (calls[0].is_meta and "object" not in op):
        return
    _EXECUTORS[op](calls)


def _snapshot_aliased(calls, src="inp", dst="out"):
    """Inputs, with those that may alias their own rank's output copied first."""
    ins = []
    for c in calls:
        i, o = c.bufs.get(src), c.bufs.get(dst)
        a = None if i is None else i.array
        if a is not None and o is not None and np.may_share_memory(a, o.array):
            a = a.copy()
        ins.append(a)
    return ins


def _combine(calls, arrays, proto):
    return reduce_arrays(arrays, calls[0].reduce_op, proto.widen, proto.narrow)


def _all_reduce(calls):
    b = calls[0].bufs["tensor"]
    res = _combine(calls, [c.bufs["tensor"].array for c in calls], b)
    for c in calls:
        np.copyto(c.bufs["tensor"].array, res, casting="no")


def _reduce_to_root(calls):
    b = calls[0].bufs["tensor"]
    res = _combine(calls, [c.bufs["tensor"].array for c in calls], b)
    np.copyto(calls[calls[0].root].bufs["tensor"].array, res, casting="no")


def _broadcast(calls):
    src = calls[calls[0].root].bufs["tensor"].array
    for c in calls:
        if c.pos != c.root:
            np.copyto(c.bufs["tensor"].array, src, casting="no")


def _all_gather(calls):
    ins = _snapshot_aliased(calls)
    m = calls[0].bufs["inp"].numel
    for c in calls:
        out = _flat(c.bufs["out"].array)
        for k, a in enumerate(ins):
            out[k * m:(k + 1) * m] = _flat(a)


def _reduce_scatter(calls):
    m = calls[0].bufs["out"].numel
    ins = [_flat(c.bufs["inp"].array) for c in calls]
    proto = calls[0].bufs["inp"]
    results = [_combine(calls, [a[j * m:(j + 1) * m] for a in ins], proto) for j in range(len(calls))]
    for c, res in zip(calls, results):
        _flat(c.bufs["out"].array)[:] = res


def _all_to_all(calls):
    ins = _snapshot_aliased(calls)
    in_off = [np.concatenate([[0], np.cumsum(c.in_splits)]) for c in calls]
    for j, c in enumerate(calls):
        out = c.bufs["out"].array
        o = 0
        for k, a in enumerate(ins):
            rows = c.out_splits[k]
            start = in_off[k][j]
            out[o:o + rows] = a[start:start + rows]
            o += rows


def _scatter(calls):
    root = calls[calls[0].root]
    src = _flat(_snapshot_aliased([root])[0])
    m = calls[0].bufs["out"].numel
    for c in calls:
        _flat(c.bufs["out"].array)[:] = src[c.pos * m:(c.pos + 1) * m]


def _gather(calls):
    root = calls[calls[0].root]
    ins = _snapshot_aliased(calls)
    m = calls[0].bufs["inp"].numel
    out = _flat(root.bufs["out"].array)
    for k, a in enumerate(ins):
        out[k * m:(k + 1) * m] = _flat(a)


def _send(calls):
    s, r = calls
    dst = r.bufs["tensor"].array
    np.copyto(dst, s.bufs["tensor"].array.reshape(dst.shape), casting="no")


def _objects(calls):
    if calls[0].op == "broadcast_object":
        root = calls[calls[0].root]
        payload = pickle.dumps(root.obj)
        for c in calls:
            c.result = root.obj if c is root else pickle.loads(payload)
            c.set_object_size(len(payload))
    else:
        payloads = [pickle.dumps(c.obj) for c in calls]
        size = len(calls) * max(len(p) for p in payloads)  # torch pads to the largest
        for c in calls:
            c.result = [pickle.loads(p) for p in payloads]
            c.set_object_size(size)


_EXECUTORS = {
    "all_reduce": _all_reduce,
    "reduce": _reduce_to_root,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "scatter": _scatter,
    "gather": _gather,
    "send": _send,
    "broadcast_object": _objects,
    "all_gather_object": _objects,
}


def as_if_identical(call, n: int) -> None:
    """The result of `call` had every one of the group's n members made the same call with
    the same data (stand-ins: sim_world.py). Defined for the collectives whose result that
    fixes; others must be on meta tensors."""
    b = call.bufs
    if call.op == "all_reduce":
        a = b["tensor"].array
        if call.reduce_op == ReduceOp.SUM:
            a *= n
        elif call.reduce_op == ReduceOp.PRODUCT:
            a **= n
        return  # AVG, MAX, MIN of equal values: the value
    if call.op in ("all_gather", "all_to_all"):
        inp, out = b["inp"].array.reshape(-1), b["out"].array.reshape(-1)
        if call.op == "all_gather":
            chunk = inp
        else:  # every member sends me what I send to my own position
            splits = call.in_splits or [len(inp) // n] * n
            row = inp.size // max(1, sum(splits)) if sum(splits) else 0
            start = sum(splits[:call.pos]) * row
            chunk = inp[start:start + splits[call.pos] * row]
        out[:] = np.tile(chunk, n)[:out.size]
        return
    raise CollectiveMismatchError(f"rank {call.rank}: {call.op} on group {list(call.group)} with stand-in ranks moves "
                                  f"no data: its tensors must be meta tensors ({call.describe()})")
