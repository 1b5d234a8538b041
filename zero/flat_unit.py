"""One FSDP-style unit of ZeRO (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models"; Zhao et al. 2023, "PyTorch FSDP"): a group of
parameters flattened into one buffer and split into `n` equal shards.

The flat buffer holds the parameters one after another, padded at the end so that its
length is a multiple of `n` (reduce-scatter and all-gather need equal chunks); rank r owns
elements [r·shard, (r+1)·shard). With Ψ not divisible by n the last ranks own fewer real
elements (or only padding): the padding holds zeros, gets zero gradients and stays zero
under AdamW.

The unit's parameters are views into the flat buffer, so the model runs unchanged. When
parameters are sharded (stage 3) the flat buffer's storage is resized to zero bytes
between uses and filled again by an all-gather: the views, and any tensor autograd saved
from them, see the gathered values again (as FSDP does).
"""
from __future__ import annotations

import torch

from model.placement import Flat
from model.regions import resize_storage


class FlatUnit:
    def __init__(self, index: int, name: str, placed_params: list, n: int, rank: int, compute_dtype):
        """`placed_params`: [(Placement, parameter)], the placement saying where the local
        parameter (maybe already a tensor-parallel slice) sits in the reference."""
        self.index, self.name = index, name
        self.placements = [pl for pl, _ in placed_params]
        self.params = [p for _, p in placed_params]
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard = -(-total // n)  # ceil
        self.padded = self.shard * n
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        self.compute_dtype = compute_dtype
        device = self.params[0].device
        # the full values, in the dtype the model was built in (the master dtype)
        self.initial = torch.zeros(self.padded, dtype=self.params[0].dtype, device=device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                self.initial[off:off + p.numel()].copy_(p.reshape(-1))
        self.flat = self.initial.to(compute_dtype, copy=True)
        for p, off in zip(self.params, self.offsets):
            p.data = self.flat[off:off + p.numel()].view(p.shape)
        self.gathered = True
        self.gather_work = self.gather_input = None

    @property
    def nbytes(self) -> int:
        return self.padded * self.flat.element_size()

    # -- stage 3: gather and free -----------------------------------------------------------
    def free(self) -> None:
        """Drop the gathered parameters (the views stay, pointing at zero bytes)."""
        if self.gathered:
            resize_storage(self.flat, 0)
            self.gathered = False

    def gather(self, group, shard: torch.Tensor, label: str):
        """Start the all-gather of every rank's `shard` into the flat buffer (async); the
        shard is held (`gather_input`) until the all-gather is done."""
        if self.gathered or self.gather_work is not None:
            return None
        resize_storage(self.flat, self.nbytes)
        self.gather_input = shard
        self.gather_work = group.all_gather(self.flat, shard, async_op=True, label=label)
        return self.gather_work

    def wait_gathered(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = self.gather_input = None
            self.gathered = True

    # -- Contract 4 ---------------------------------------------------------------------------
    def owned(self):
        """(placement, local start) of each parameter part in this rank's shard: elements
        [a, b) of the flattened local parameter, at `local start` in the shard."""
        out = []
        for pl, p, off in zip(self.placements, self.params, self.offsets):
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                out.append((pl.then(Flat(a - off, b - off)), a - self.lo))
        return out

    def view_of(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of a full flat buffer, shaped like the parameter."""
        off, p = self.offsets[i], self.params[i]
        return buffer[off:off + p.numel()].view(p.shape)
