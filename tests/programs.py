"""SPMD programs shared by the collective tests; module-level so gloo processes can import them."""
import zlib

import torch

from collectives import Mesh, P2POp, ReduceOp

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
REDUCE_OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT]


def data(seed, global_rank, tag, shape, dtype, positive=False):
    """The random input of one rank for one op, a pure function of its arguments."""
    g = torch.Generator().manual_seed(zlib.crc32(repr((seed, global_rank, tag)).encode()))
    x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5 if positive else \
        torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(DTYPES[dtype])


def pick_group(world, kind):
    """The group a test runs its ops on: the world, a sub-group (ranks given in reverse order:
    group ranks follow ascending global rank anyway, as in torch), or a mesh axis."""
    n = world.size
    if kind == "world":
        return world
    if kind == "subgroup":
        groups = [sorted((r for r in range(n) if r % 2 == parity), reverse=True) for parity in (0, 1)]
        made = [world.new_group(ranks) if ranks else None for ranks in groups]
        return made[world.rank % 2]
    if kind == "mesh":
        k = next((d for d in range(2, n + 1) if n % d == 0), 1)
        mesh = Mesh(world, x=k, y=n // k)
        return mesh.group("x")  # strided ranks: the outer axis
    raise ValueError(kind)


def all_ops(world, kind, dtype, seed=0, device="cpu"):
    """Every collective on `pick_group(world, kind)` with tensors on `device`; returns the
    group's ranks and each output (on the CPU)."""
    g = pick_group(world, kind)
    d = lambda *a, **k: data(*a, **k).to(device)  # noqa: E731
    empty = lambda *shape: torch.empty(shape, dtype=dt, device=device)  # noqa: E731
    n, p, me = g.size, g.rank, world.rank
    dt = DTYPES[dtype]
    out = {"ranks": list(g.ranks)}
    for op in REDUCE_OPS:
        t = d(seed, me, f"ar-{op.name}", (3, 5), dtype, positive=op is ReduceOp.PRODUCT)
        g.all_reduce(t, op=op, label=f"ar-{op.name}")
        out[f"all_reduce-{op.name}"] = t
    t = d(seed, me, "reduce", (4,), dtype)
    g.reduce(t, dst=n - 1, op=ReduceOp.SUM)
    out["reduce"] = t
    t = d(seed, me, "bcast", (2, 3), dtype)
    g.broadcast(t, src=n // 2)
    out["broadcast"] = t
    inp = d(seed, me, "ag", (2, 3), dtype)
    o = empty(2 * n, 3)
    g.all_gather(o, inp)
    out["all_gather"] = o
    inp = d(seed, me, "rs", (2 * n, 3), dtype)
    o = empty(2, 3)
    g.reduce_scatter(o, inp)
    out["reduce_scatter"] = o
    in_splits = [(p + 2 * j) % 3 for j in range(n)]
    out_splits = [(j + 2 * p) % 3 for j in range(n)]
    inp = d(seed, me, "a2a", (sum(in_splits), 2), dtype)
    o = empty(sum(out_splits), 2)
    g.all_to_all(o, inp, out_splits=out_splits, in_splits=in_splits)
    out["all_to_all"] = o
    o = empty(2,)
    g.scatter(o, d(seed, me, "scatter", (2 * n,), dtype) if p == 0 else None, src=0)
    out["scatter"] = o
    o = empty(3 * n,) if p == n - 1 else None
    g.gather(o, d(seed, me, "gather", (3,), dtype), dst=n - 1)
    out["gather"] = o
    if n > 1:
        # a ring exchange in one batch, then blocking send/recv ordered to avoid deadlock
        recv = empty(4,)
        works = g.batch_isend_irecv([P2POp("isend", d(seed, me, "ring", (4,), dtype), (p + 1) % n),
                                     P2POp("irecv", recv, (p - 1) % n)])
        for w in works:
            w.wait()
        out["ring"] = recv
        got = empty(2,)
        mine = d(seed, me, "pair", (2,), dtype)
        if p % 2 == 0 and p + 1 < n:
            g.send(mine, p + 1)
            g.recv(got, p + 1)
        elif p % 2 == 1:
            g.recv(got, p - 1)
            g.send(mine, p - 1)
        out["pair"] = got if (p % 2 == 1 or p + 1 < n) else None  # the last of an odd group has no partner
    t = d(seed, me, "async", (5,), dtype)
    w = g.all_reduce(t, async_op=True, label="async")
    w.wait()
    out["async"] = t
    out["broadcast_object"] = g.broadcast_object({"from": me, "list": [me] * 3} if p == n - 1 else None, src=n - 1)
    out["all_gather_object"] = g.all_gather_object(("rank", me))
    g.barrier()
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}
