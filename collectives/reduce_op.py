"""Reduction operators and the fixed-order NumPy reduction behind the simulated backend.

Determinism: a reduction over a group combines the contributions strictly in group-rank
order, ((x0 ∘ x1) ∘ x2) ∘ ..., so the result is bit-identical from run to run whatever
the thread timing.

Accumulation dtype: float16 and bfloat16 inputs are widened to float32, combined in
float32 and rounded once (round to nearest even) to the input dtype at the end. NCCL
rounds after every step of its ring instead, so for these two dtypes the simulator is at
least as accurate as NCCL, not bit-identical to it. Every other dtype is combined in
itself (integers wrap as in NumPy).
"""
from __future__ import annotations

import enum

import numpy as np


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"


_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PRODUCT: np.multiply,
}


def reduce_arrays(arrays, op: ReduceOp, widen, narrow):
    """Combine `arrays` (one per group rank, group-rank order) into a fresh array.

    `widen(a)` returns `a` in the accumulation dtype (a copy is not required);
    `narrow(acc)` converts the accumulator back to the storage dtype.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a ReduceOp, got {op!r}")
    acc = np.array(widen(arrays[0]), copy=True)
    if op is ReduceOp.AVG and not np.issubdtype(acc.dtype, np.floating):
        raise TypeError(f"ReduceOp.AVG needs a floating dtype, got {acc.dtype}")
    ufunc = _UFUNC[op]
    for a in arrays[1:]:
        ufunc(acc, widen(a), out=acc)
    if op is ReduceOp.AVG:
        np.divide(acc, len(arrays), out=acc)
    return narrow(acc)
