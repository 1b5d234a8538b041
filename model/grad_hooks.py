"""Knowing when gradients are ready during backward: the machinery DDP's buckets and
ZeRO's units share (Li et al. 2020, "PyTorch Distributed", section 3.2.3: a bucket is
reduced as soon as its last gradient is ready; Rajbhandari et al. 2019, ZeRO, section 5:
a unit's gradient is reduced as soon as its backward is done).

Parameters are grouped (buckets, units). In each backward:
- `on_grad(param)` runs as each parameter's gradient has been accumulated
  (`register_post_accumulate_grad_hook`);
- `on_ready(group, [])` runs when the last parameter of a group has had it;
- at the end of the backward (an autograd engine callback, as torch's DDP and FSDP use),
  `on_ready(group, pending)` runs for each group some of whose parameters received no
  gradient (they contribute zeros, like find_unused_parameters=True), then `on_end()`.

`no_sync()` sets `require_sync` False inside it: the callbacks read it to decide whether
to reduce (gradient accumulation reduces once, at the last microbatch).

A syncing backward may give none of a wrapper's parameters a gradient: a pipeline's split
backward (zero-bubble) gives the parameters outside linear layers (the experts' batched
weights) theirs in the I pass, under `no_sync`, and syncs in the W pass. `ended` counts
the backwards this object has ended; `end()` ends one by hand, every group pending, so
the gradients accumulated before are reduced as any unused parameter's would be.
"""
from __future__ import annotations

import contextlib
import weakref

import torch


class GradientReady:
    def __init__(self, groups: list, params_of, on_ready, on_end, on_grad=None):
        """`groups`: opaque group objects; `params_of(group)`: its parameters."""
        self.groups = list(groups)
        self._members = [list(params_of(g)) for g in self.groups]
        self._group_of = {p: i for i, m in enumerate(self._members) for p in m}
        self.on_ready, self.on_end, self.on_grad = on_ready, on_end, on_grad
        self.require_sync = True
        self.ended = 0  # backwards ended (by the engine's callback, or by `end`)
        self._armed = False
        self._pending = [set(m) for m in self._members]
        # the hooks live on the parameters, outside what Python's garbage collector sees: a
        # strong reference from them back to this object (and through it to the strategy, its
        # process groups and the whole simulated world) would never be freed; a planner that
        # plans layout after layout grew by every plan's world
        this = weakref.ref(self)

        def grad_ready(p):
            ready = this()
            if ready is not None:
                ready._grad_ready(p)
        self._hooks = [p.register_post_accumulate_grad_hook(grad_ready) for m in self._members for p in m]

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after it reduces them."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _grad_ready(self, p) -> None:
        if not self._armed:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.on_grad is not None:
            self.on_grad(p)
        i = self._group_of[p]
        pending = self._pending[i]
        pending.discard(p)
        if not pending:
            self._pending[i] = None  # ready: not forced again at the end
            self.on_ready(self.groups[i], [])

    def _end_of_backward(self) -> None:
        for i, pending in enumerate(self._pending):
            if pending is not None:
                self.on_ready(self.groups[i], [p for p in self._members[i] if p in pending])
        self.on_end()
        self._pending = [set(m) for m in self._members]
        self._armed = False
        self.ended += 1

    def end(self) -> None:
        """End a syncing backward that gave none of these parameters a gradient: each group's
        accumulated gradients are reduced as at the end of a backward."""
        if self._armed:
            raise RuntimeError("GradientReady.end() inside a backward that reached these parameters")
        self._end_of_backward()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
