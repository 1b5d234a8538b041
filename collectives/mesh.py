"""`Mesh`: named axes over a group of ranks (like torch's DeviceMesh).

`Mesh(world, pp=2, dp=2, tp=2)` lays the ranks out row-major with the axes outermost
first, so the last axis varies fastest: rank = ((pp·DP) + dp)·TP + tp. `mesh.group("tp")`
is the group of ranks that differ only in their tp coordinate; `mesh.group("dp", "cp")`
those that differ only in dp and cp (group-rank order follows the mesh order). Groups are
created on first use, every group of the axis set on every rank, in one deterministic
order, as torch.distributed requires; so every rank must ask for the same axis sets in
the same order.

An axis can be laid out over sub-axes (`split`): `Mesh(world, pp=1, dp=8, tp=2,
split={"dp": {"dp_replicate": 2, "dp_shard": 4}})` numbers the ranks exactly as without it
(dp = dp_replicate·4 + dp_shard), and `mesh.group("dp_shard")` is the group of the ranks
that differ only in dp_shard (hybrid sharding's shard group; torchtitan's
`dp_replicate × dp_shard`), while `mesh.group("dp")` is still every data-parallel rank.
"""
from __future__ import annotations

import itertools
import math


class Mesh:
    def __init__(self, group, split: dict | None = None, **axes: int):
        split = {k: v for k, v in (split or {}).items() if len(v) > 1}
        for axis, subs in split.items():
            if axis not in axes or math.prod(subs.values()) != axes[axis]:
                raise ValueError(f"Mesh split of {axis!r}: {subs} must multiply to its size {axes.get(axis)}")
        self.aliases = {axis: tuple(subs) for axis, subs in split.items()}  # an axis -> its sub-axes
        axes = {k: v for axis, size in axes.items() for k, v in (split[axis].items() if axis in split
                                                                  else [(axis, size)])}
        if not axes:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh(world, dp=2, tp=2)")
        bad = {k: v for k, v in axes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"Mesh axis sizes must be positive integers, got {bad}")
        total = math.prod(axes.values())
        if total != group.size:
            shape = " × ".join(f"{k}={v}" for k, v in axes.items())
            raise ValueError(f"Mesh {shape} = {total} ranks, but the group has {group.size} ranks")
        self.parent = group
        self.names = tuple(axes)
        self.shape = dict(axes)
        self._coords = self.coords_of(group.rank)
        self._groups: dict = {}

    @property
    def rank(self) -> int:
        return self.parent.rank

    def size(self, axis: str | None = None) -> int:
        if axis is None:
            return self.parent.size
        return math.prod(self.shape[self._check(a)] for a in self.aliases.get(axis, (axis,)))

    def coord(self, axis: str) -> int:
        c = 0
        for a in self.aliases.get(axis, (axis,)):
            c = c * self.shape[a] + self._coords[self.names.index(self._check(a))]
        return c

    def coords_of(self, rank: int) -> tuple:
        return coords_of(self.shape, rank)

    def rank_of(self, **coords: int) -> int:
        """Group rank at the given coordinates (missing axes: this rank's coordinate)."""
        return self._rank_at({n: coords.get(n, self.coord(n)) for n in self.names})

    def _check(self, axis: str) -> str:
        if axis not in self.shape:
            raise ValueError(f"unknown mesh axis {axis!r}; this mesh has {list(self.names)}")
        return axis

    def group(self, *axes: str):
        """The group of ranks that differ from this rank only along `axes`."""
        if not axes:
            raise ValueError("mesh.group needs at least one axis")
        axes = tuple(a for axis in axes for a in self.aliases.get(axis, (axis,)))
        for a in axes:
            self._check(a)
        key = tuple(sorted(set(axes), key=self.names.index))
        if key not in self._groups:
            self._groups[key] = self._make(key)
        return self._groups[key]

    def _make(self, axes):
        others = [n for n in self.names if n not in axes]
        mine = None
        for fixed in itertools.product(*(range(self.shape[n]) for n in others)):
            g = self.parent.new_group(ranks_along(self.shape, dict(zip(others, fixed)), axes))
            if g is not None:
                mine = g
        return mine

    def _rank_at(self, coords) -> int:
        r = 0
        for name in self.names:
            r = r * self.shape[name] + coords[name]
        return r

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{k}={v}' for k, v in self.shape.items())}; rank {self.rank} at {self._coords})"


def coords_of(shape: dict, rank: int) -> tuple:
    """The coordinates of `rank` on a mesh of `shape` ({axis: size}, outermost first)."""
    out = []
    for name in reversed(list(shape)):
        rank, c = divmod(rank, shape[name])
        out.append(c)
    return tuple(reversed(out))


def ranks_along(shape: dict, coords: dict, axes) -> list:
    """The ranks of a mesh of `shape` that differ from `coords` only along `axes`, in group-rank
    order (row-major over the axes, in mesh order); the group `Mesh.group(*axes)` makes."""
    ranks = [0]
    for name, n in shape.items():
        values = range(n) if name in axes else (coords[name],)
        ranks = [r * n + v for r in ranks for v in values]
    return ranks
