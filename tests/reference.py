"""NumPy/torch references for tests/programs.all_ops, computed independently of the
simulator: reductions in group-rank order in the documented accumulation dtype
(float32 for bfloat16), data movement by slicing."""
import functools

import torch

from programs import DTYPES, REDUCE_OPS, data
from collectives import ReduceOp

_COMBINE = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum, ReduceOp.PRODUCT: torch.mul,
}


def reduce_ref(xs, op, dtype):
    acc_dtype = torch.float32 if dtype == "bfloat16" else DTYPES[dtype]
    acc = functools.reduce(_COMBINE[op], [x.to(acc_dtype) for x in xs])
    if op is ReduceOp.AVG:
        acc = acc / len(xs)
    return acc.to(DTYPES[dtype])


def expected(ranks, p, dtype, seed=0):
    """What group position `p` of a group with global `ranks` must get from all_ops."""
    n, me = len(ranks), ranks[p]
    d = functools.partial(data, seed)
    exp = {"ranks": list(ranks)}
    for op in REDUCE_OPS:
        exp[f"all_reduce-{op.name}"] = reduce_ref(
            [d(r, f"ar-{op.name}", (3, 5), dtype, positive=op is ReduceOp.PRODUCT) for r in ranks], op, dtype)
    exp["reduce"] = (reduce_ref([d(r, "reduce", (4,), dtype) for r in ranks], ReduceOp.SUM, dtype)
                     if p == n - 1 else d(me, "reduce", (4,), dtype))
    exp["broadcast"] = d(ranks[n // 2], "bcast", (2, 3), dtype)
    exp["all_gather"] = torch.cat([d(r, "ag", (2, 3), dtype) for r in ranks])
    exp["reduce_scatter"] = reduce_ref([d(r, "rs", (2 * n, 3), dtype)[2 * p:2 * p + 2] for r in ranks],
                                       ReduceOp.SUM, dtype)
    chunks = []
    for j, r in enumerate(ranks):  # rank j sends rows of its own split for p
        splits = [(j + 2 * k) % 3 for k in range(n)]
        start = sum(splits[:p])
        chunks.append(d(r, "a2a", (sum(splits), 2), dtype)[start:start + splits[p]])
    exp["all_to_all"] = torch.cat(chunks)
    exp["scatter"] = d(ranks[0], "scatter", (2 * n,), dtype)[2 * p:2 * p + 2]
    exp["gather"] = torch.cat([d(r, "gather", (3,), dtype) for r in ranks]) if p == n - 1 else None
    if n > 1:
        exp["ring"] = d(ranks[(p - 1) % n], "ring", (4,), dtype)
        partner = p + 1 if p % 2 == 0 else p - 1
        exp["pair"] = d(ranks[partner], "pair", (2,), dtype) if partner < n else None
    exp["async"] = reduce_ref([d(r, "async", (5,), dtype) for r in ranks], ReduceOp.SUM, dtype)
    exp["broadcast_object"] = {"from": ranks[-1], "list": [ranks[-1]] * 3}
    exp["all_gather_object"] = [("rank", r) for r in ranks]
    return exp
