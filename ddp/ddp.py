"""Data parallelism over a `ProcessGroup`: bucketed gradient all-reduce overlapped with
backward, as in PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB).

- On wrapping, parameters are broadcast from group rank 0, so every replica starts equal.
- Parameters are packed into buckets of at most `bucket_cap_mb`, in reverse order of
  registration (the order backward produces their gradients).
- A hook fires after each parameter's gradient is accumulated; when a bucket's last
  gradient is ready, its gradients are copied into one flat buffer and an asynchronous
  all-reduce (AVG) starts at once, labelled `<label>.bucket<i>`, overlapping the rest of
  backward. At the end of backward every bucket is waited once and the averaged
  gradients are copied back.
- `no_sync()` skips the reduction: gradients accumulate locally, and the next backward
  outside it reduces the accumulated sum.
- Parameters that received no gradient in a backward contribute zeros (like
  find_unused_parameters=True), so every rank still joins every bucket's all-reduce.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from collectives import ReduceOp


class Bucket:
    def __init__(self, index: int, params: list):
        self.index = index
        self.params = params
        self.pending = set()
        self.flat = None
        self.work = None


class DistributedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, group, bucket_cap_mb: float = 25.0, label: str = "ddp"):
        super().__init__()
        self.module = module
        self.group = group
        self.label = label
        self.require_sync = True
        with torch.no_grad():
            for name, p in module.named_parameters():
                group.broadcast(p.data, src=0, label=f"{label}.broadcast")
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = self._make_buckets(list(reversed(params)), bucket_cap_mb * 2**20)
        self._bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[p] = b
        self._armed = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self._reset()

    @staticmethod
    def _make_buckets(params, cap_bytes):
        buckets, current, size = [], [], 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > cap_bytes:
                buckets.append(Bucket(len(buckets), current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            buckets.append(Bucket(len(buckets), current))
        return buckets

    def _reset(self):
        for b in self.buckets:
            b.pending = set(b.params)
            b.flat = None
            b.work = None
        self._armed = False

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after it reduces them."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- the hooks ----------------------------------------------------------------------
    def _grad_ready(self, p):
        if not self.require_sync:
            return
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self._bucket_of[p]
        b.pending.discard(p)
        if not b.pending:
            self._launch(b)

    def _launch(self, b: Bucket):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        b.flat = torch.cat([g.reshape(-1) for g in grads])
        b.work = self.group.all_reduce(b.flat, op=ReduceOp.AVG, async_op=True, label=f"{self.label}.bucket{b.index}")

    def _finish(self):
        """End of backward: launch buckets with unused parameters, wait every bucket once,
        and copy the averaged gradients back."""
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        for b in self.buckets:
            b.work.wait()
            offset = 0
            for p in b.params:
                n = p.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(b.flat[offset:offset + n].view_as(p))
                offset += n
        self._reset()
