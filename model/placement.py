"""Where a local tensor sits in the reference model: one typed placement for every
strategy (docs/architecture.md, "Placements").

A `Placement` names a reference parameter (`blocks.3.attn.wq.weight`), its full shape,
and the cuts that turn the full tensor into the local one, applied in order:

- no cut: the whole tensor (a replica, or a pipeline stage's own parameter);
- `Shard(dim, start, stop, length)`: elements [start, stop) along `dim`, held in a local
  dimension of `length` ≥ stop − start whose tail is padding (Megatron's vocabulary
  padded to a multiple of tp; an expert range);
- `Flat(start, stop)`: elements [start, stop) of the flattened tensor so far (a ZeRO
  shard cuts across rows; after a `Shard` it indexes the padded local slice).

So a ZeRO-3 shard of a tensor-parallel embedding is
`Placement("tok_emb.weight", (61, 32), (Shard(0, 31, 61, 31), Flat(0, 500)))`.
Initialisation (`model.init`), the gather of the equivalence check (`assemble`) and
checkpoints read only this.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shard:
    dim: int
    start: int
    stop: int
    length: int  # the local size along dim; the part beyond stop - start is padding

    def __post_init__(self):
        if not 0 <= self.start <= self.stop or self.length < self.stop - self.start:
            raise ValueError(f"Shard(dim={self.dim}, start={self.start}, stop={self.stop}, length={self.length}): "
                             f"needs 0 <= start <= stop and length >= stop - start")

    def shape(self, shape: tuple) -> tuple:
        return shape[:self.dim] + (self.length,) + shape[self.dim + 1:]

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        part = t.narrow(self.dim, self.start, self.stop - self.start)
        if self.length == self.stop - self.start:
            return part
        out = torch.zeros(self.shape(tuple(t.shape)), dtype=t.dtype, device=t.device)
        out.narrow(self.dim, 0, self.stop - self.start).copy_(part)
        return out

    def __str__(self) -> str:
        pad = f" (+{self.length - self.stop + self.start} padding)" if self.length > self.stop - self.start else ""
        return f"dim {self.dim} [{self.start}:{self.stop}]{pad}"


@dataclass(frozen=True)
class Flat:
    start: int
    stop: int

    def shape(self, shape: tuple) -> tuple:
        return (self.stop - self.start,)

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1)[self.start:self.stop]

    def __str__(self) -> str:
        return f"flat [{self.start}:{self.stop}]"


@dataclass(frozen=True)
class Placement:
    name: str  # the reference parameter's name
    shape: tuple  # its full shape
    cuts: tuple = ()  # Shard / Flat, outermost first

    def then(self, cut) -> "Placement":
        """This placement cut once more (a ZeRO flat range of a tensor-parallel slice)."""
        return Placement(self.name, self.shape, self.cuts + (cut,))

    @property
    def local_shape(self) -> tuple:
        shape = tuple(self.shape)
        for c in self.cuts:
            shape = c.shape(shape)
        return shape

    @property
    def padded(self) -> bool:
        return any(isinstance(c, Shard) and c.length > c.stop - c.start for c in self.cuts)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """The local tensor cut from the full one (padding zero)."""
        t = full
        for c in self.cuts:
            t = c.apply(t)
        return t

    def index(self) -> torch.Tensor:
        """For each local element, its flat index into the full tensor; -1 for padding."""
        t = torch.arange(int(torch.Size(self.shape).numel()), dtype=torch.int64).view(self.shape)
        for c in self.cuts:
            if isinstance(c, Shard) and c.length > c.stop - c.start:
                out = torch.full(c.shape(tuple(t.shape)), -1, dtype=torch.int64)
                out.narrow(c.dim, 0, c.stop - c.start).copy_(t.narrow(c.dim, c.start, c.stop - c.start))
                t = out
            else:
                t = c.apply(t)
        return t

    def region(self, full: torch.Tensor):
        """(the view of `full` that the local tensor's real elements sit in, (dim, length) that
        cuts the local tensor's padding off, or None), where the cuts are views: slices, and
        flat ranges of a contiguous slice; else None (a flat range of a strided slice, a cut
        of padding), and `index` maps element by element."""
        v, pad = full, None
        for c in self.cuts:
            if pad is not None:
                return None
            if isinstance(c, Shard):
                v = v.narrow(c.dim, c.start, c.stop - c.start)
                if c.length > c.stop - c.start:
                    pad = (c.dim, c.stop - c.start)
            elif v.is_contiguous() and c.stop <= v.numel():
                v = v.view(-1)[c.start:c.stop]
            else:
                return None
        return v, pad

    def __str__(self) -> str:
        return f"{self.name}{list(self.shape)}" + "".join(f" {c}" for c in self.cuts)


def placement_of(name: str, param: torch.Tensor) -> Placement:
    """The placement a strategy attached to `param` (`set_placement`), or the whole tensor.
    `name` is the parameter's name in the (pruned, swapped) reference model, which is its
    reference name; an attached placement must agree."""
    p = getattr(param, "placement", None)
    if p is None:
        return Placement(name, tuple(param.shape))
    if p.name != name:
        raise ValueError(f"parameter {name!r} carries the placement of {p.name!r}")
    return p


def set_placement(param: torch.Tensor, placement: Placement) -> None:
    if tuple(param.shape) != placement.local_shape:
        raise ValueError(f"{placement}: local shape {placement.local_shape} but the tensor is {tuple(param.shape)}")
    param.placement = placement


def elements(pl: Placement, full: torch.Tensor, t: torch.Tensor) -> tuple:
    """(the elements of `full` that the local tensor `t` of placement `pl` holds, `t`'s values
    of them), alike in shape: views where the cuts are views (`Placement.region`), else copies
    through the index map (padding left out)."""
    region = pl.region(full)
    if region is not None:
        target, pad = region
        return target, t if pad is None else t.narrow(pad[0], 0, pad[1])
    idx = pl.index().reshape(-1)
    real = idx >= 0
    return full.view(-1)[idx[real]], t.reshape(-1)[real]


def paste(pl: Placement, full: torch.Tensor, t: torch.Tensor) -> None:
    """Write the local tensor `t` of placement `pl` into `full` (its padding left out)."""
    region = pl.region(full)
    if region is not None:
        target, pad = region
        target.copy_(t if pad is None else t.narrow(pad[0], 0, pad[1]))
    else:  # (no view: through the index map)
        idx = pl.index().reshape(-1)
        real = idx >= 0
        full.view(-1)[idx[real]] = t.reshape(-1)[real]


def assemble(per_rank: list) -> tuple[dict, list]:
    """Full tensors from every rank's [(Placement, tensor)]; returns (full, problems):
    elements no rank holds, tensors that do not fit their placement, and replicas that
    disagree (two ranks holding one element with different values is a bug)."""
    full, covered, problems = {}, {}, []
    for rank, items in enumerate(per_rank):
        for pl, t in items:
            if pl.name not in full:
                full[pl.name] = torch.zeros(pl.shape, dtype=t.dtype)
                covered[pl.name] = torch.zeros(pl.shape, dtype=torch.bool)
            if tuple(t.shape) != pl.local_shape:
                problems.append(f"rank {rank}: {pl.name}{list(t.shape)} does not fit its placement {pl} "
                                f"(local shape {list(pl.local_shape)})")
                continue
            old, vals = elements(pl, full[pl.name], t)
            seen = elements(pl, covered[pl.name], t)[0]
            if seen.any() and not torch.equal(old[seen], vals[seen]):
                diff = (old[seen] - vals[seen]).abs().max().item()
                problems.append(f"rank {rank}: its copy of {pl.name} differs from another rank's "
                                f"by up to {diff:.3g} (replicas must be equal)")
            paste(pl, full[pl.name], t)
            paste(pl, covered[pl.name], torch.ones(t.shape, dtype=torch.bool))
    for name, seen in covered.items():
        if not seen.all():
            problems.append(f"{name}: {int((~seen).sum())} of {seen.numel()} elements are held by no rank")
    return full, problems


def placement_to_dict(p: Placement) -> dict:
    """A JSON-able form (checkpoint indexes)."""
    cuts = [{"shard": [c.dim, c.start, c.stop, c.length]} if isinstance(c, Shard) else {"flat": [c.start, c.stop]}
            for c in p.cuts]
    return {"name": p.name, "shape": list(p.shape), "cuts": cuts}


def placement_from_dict(d: dict) -> Placement:
    cuts = tuple(Shard(*c["shard"]) if "shard" in c else Flat(*c["flat"]) for c in d["cuts"])
    return Placement(d["name"], tuple(d["shape"]), cuts)


def covered_range(p: Placement) -> tuple:
    """(lowest, highest + 1) flat index of the full tensor that the local tensor holds."""
    idx = p.index()
    real = idx[idx >= 0]
    return (int(real.min()), int(real.max()) + 1) if real.numel() else (0, 0)
