"""Contract 4: every local tensor knows where it sits in the reference.

A strategy describes each local parameter as a `Piece`: the reference parameter's name
and full shape, and the index (a tuple of slices) of the part it holds, or None for the
whole tensor, or `flat=(start, stop)`: elements [start, stop) of the flattened tensor
(ZeRO's flat shards cut across rows). `assemble` rebuilds full tensors from the pieces of every rank, checks that
every element is covered, and reports replicas that disagree (two ranks holding the same
part with different values is a bug, e.g. DDP replicas drifting apart).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    ref_name: str
    full_shape: tuple
    index: tuple | None = None  # slices into the full tensor; None: the whole tensor
    flat: tuple | None = None  # (start, stop) into the flattened full tensor, instead of index

    def region(self, full: torch.Tensor) -> torch.Tensor:
        """The part of `full` (shaped like the reference parameter) this piece holds, as a view."""
        if self.flat is not None:
            return full.view(-1)[self.flat[0]:self.flat[1]]
        return full[self.index] if self.index is not None else full


def whole_pieces(module) -> dict:
    """Pieces of a module whose parameter names are the reference names and whose
    parameters are whole (data parallel replicas)."""
    return {name: Piece(name, tuple(p.shape)) for name, p in module.named_parameters()}


def snapshot(module, pieces: dict, what: str = "param") -> list:
    """[(Piece, CPU float64 copy)] of the parameters (`what`="param") or their gradients."""
    out = []
    for name, p in module.named_parameters():
        t = p if what == "param" else p.grad
        if t is None:
            continue
        out.append((pieces[name], t.detach().to("cpu", torch.float64).clone()))
    return out


def assemble(per_rank: list) -> tuple[dict, list]:
    """Full tensors from every rank's [(Piece, tensor)]; returns (full, problems)."""
    full, covered, problems = {}, {}, []
    for rank, items in enumerate(per_rank):
        for piece, t in items:
            if piece.ref_name not in full:
                full[piece.ref_name] = torch.zeros(piece.full_shape, dtype=t.dtype)
                covered[piece.ref_name] = torch.zeros(piece.full_shape, dtype=torch.bool)
            target, seen = piece.region(full[piece.ref_name]), piece.region(covered[piece.ref_name])
            if target.shape != t.shape:
                problems.append(f"rank {rank}: {piece.ref_name}{list(t.shape)} does not fit its index "
                                f"({list(target.shape)})")
                continue
            if seen.any() and not torch.equal(target[seen], t[seen]):
                diff = (target[seen] - t[seen]).abs().max().item()
                problems.append(f"rank {rank}: its copy of {piece.ref_name} differs from another rank's "
                                f"by up to {diff:.3g} (replicas must be equal)")
            target.copy_(t)
            seen.fill_(True)
    for name, seen in covered.items():
        if not seen.all():
            problems.append(f"{name}: {int((~seen).sum())} of {seen.numel()} elements are held by no rank")
    return full, problems
