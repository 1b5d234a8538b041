"""Data parallelism over a `ProcessGroup`: bucketed gradient all-reduce overlapped with
backward, as in PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB).

- On wrapping, parameters are broadcast from group rank 0, so every replica starts equal.
- Parameters are packed into buckets of at most `bucket_cap_mb`, in reverse order of
  registration (the order backward produces their gradients).
- Each bucket owns one flat buffer, and each parameter's `.grad` is a view into it (torch
  DDP's gradient_as_bucket_view): backward accumulates straight into the bucket. A hook
  fires after each parameter's gradient is accumulated (a gradient that autograd
  allocated afresh, after `zero_grad(set_to_none=True)`, is copied in once and replaced
  by the view); when a bucket's last gradient is ready an asynchronous all-reduce (AVG)
  of the flat buffer starts at once, labelled `<label>.bucket<i>`, overlapping the rest
  of backward. At the end of backward every bucket is waited once; the averaged
  gradients are already in place.
- `no_sync()` skips the reduction: gradients accumulate locally, and the next backward
  outside it reduces the accumulated sum.
- `finish_at_step=True` (under a pipeline): the end of the syncing backward does not wait;
  `finish_grad_sync()` does, once the pipeline's schedule is done (Megatron-LM's
  `finish_grad_sync`, Narayanan et al. 2021): a stage that ends a chunk's backward sends
  the input gradient on at once instead of first waiting for its reduction, which would put
  the reduction on the path of every stage before it.
- Parameters that received no gradient in a backward contribute zeros (like
  find_unused_parameters=True), so every rank still joins every bucket's all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from collectives import ReduceOp
from model.grad_hooks import GradientReady


class Bucket:
    def __init__(self, index: int, params: list):
        self.index = index
        self.params = params
        self.offsets = {}
        n = 0
        for p in params:
            self.offsets[p] = n
            n += p.numel()
        self.flat = torch.zeros(n, dtype=params[0].dtype, device=params[0].device)
        self.work = None

    def view(self, p):
        """p's slice of the flat buffer, shaped like p (made on demand: holding no extra
        reference to it lets autograd accumulate into it in place)."""
        start = self.offsets[p]
        return self.flat[start:start + p.numel()].view_as(p)

    def adopt(self, p) -> None:
        """Make p.grad the bucket view (copying a gradient autograd allocated elsewhere,
        zeros if the parameter received none)."""
        g = p.grad
        if g is not None and g.untyped_storage()._cdata == self.flat.untyped_storage()._cdata \
                and g.storage_offset() == self.flat.storage_offset() + self.offsets[p]:
            return  # already the view (storages compared: on meta every data_ptr is 0)
        v = self.view(p)
        if g is None:
            v.zero_()
        else:
            v.copy_(g)
        p.grad = v


class DistributedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, group, bucket_cap_mb: float = 25.0, label: str = "ddp", params=None,
                 grad_scale: float = 1.0, finish_at_step: bool = False):
        """`params`: the parameters this wrapper synchronises (default: all of `module`'s);
        `grad_scale`: multiplies the averaged gradients (expert parallelism's divisor);
        `finish_at_step`: the reductions are waited by `finish_grad_sync`, not at the end of
        the backward that started them."""
        super().__init__()
        self.module = module
        self.finish_at_step = finish_at_step
        self.group = group
        self.label = label
        self.grad_scale = grad_scale
        params = [p for p in (module.parameters() if params is None else params) if p.requires_grad]
        with torch.no_grad():
            for p in params:
                group.broadcast(p.data, src=0, label=f"{label}.broadcast")
        self.buckets = self._make_buckets(list(reversed(params)), bucket_cap_mb * 2**20)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self.ready = GradientReady(self.buckets, lambda b: b.params, on_ready=self._bucket_ready,
                                   on_end=self._finish, on_grad=self._grad_ready)

    @staticmethod
    def _make_buckets(params, cap_bytes):
        buckets, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            different = current and (p.dtype != current[0].dtype or p.device != current[0].device)
            if current and (size + nbytes > cap_bytes or different):
                buckets.append(Bucket(len(buckets), current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(Bucket(len(buckets), current))
        return buckets

    def no_sync(self):
        """Accumulate gradients locally; the first backward after it reduces them."""
        return self.ready.no_sync()

    def scale_loss(self, loss):
        return loss

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- the hooks (model.grad_hooks calls them) -------------------------------------------
    def _grad_ready(self, p) -> None:
        if self.ready.require_sync:
            self._bucket_of[p].adopt(p)

    def _bucket_ready(self, b: Bucket, pending: list) -> None:
        """Every gradient of `b` is in (`pending`: those that got none, at the end of backward)."""
        if not self.ready.require_sync:
            return
        for p in pending:
            b.adopt(p)
        self._launch(b)

    def _launch(self, b: Bucket) -> None:
        b.work = self.group.all_reduce(b.flat, op=ReduceOp.AVG, async_op=True, label=f"{self.label}.bucket{b.index}")

    def _finish(self) -> None:
        """End of backward: wait for every bucket once (or leave that to `finish_grad_sync`)."""
        if self.ready.require_sync and not self.finish_at_step:
            self.finish_grad_sync()

    def finish_grad_sync(self) -> None:
        """Wait for the buckets' reductions in flight (none: nothing to do)."""
        for b in self.buckets:
            if b.work is None:
                continue
            b.work.wait()
            b.work = None
            if self.grad_scale != 1.0:
                b.flat.mul_(self.grad_scale)
