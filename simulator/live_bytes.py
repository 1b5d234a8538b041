"""The bytes a rank's program holds, counted from the storages themselves: an independent
reference for the memory tracker (memory.py).

The tracker counts by category, from what it is told: autograd's saved tensors, backward's
temporaries, the buffers a strategy registers, the tensors the pipeline executor keeps. A
tensor held by a path nobody told it of is missed, and a plan is then optimistic by its
bytes. `LiveBytes` is told nothing: as a dispatch mode on the rank's thread it sees every
storage an op makes (factories included), counts its bytes once, and stops counting when
the storage dies (a weak reference to the storage object: torch keeps one Python object
per live storage, so it dies with the storage, not with a view of it). So it counts what
`torch.cuda.memory_allocated` counts on a GPU, less the allocator's rounding: the bytes of
every tensor alive now, whoever holds it; `peak` is the most at once since `reset_peak`.
Except inside a fused region (model/regions.py, `fused_kernel`: ops a GPU runs as one
kernel, which the CPU and the meta device run op by op), where only what the region leaves
counts: its intermediate tensors never exist on a GPU.

Not seen: storages made outside dispatch (`torch.UntypedStorage(n)`, `torch.from_numpy`),
which what is compared (playground/memory_audit.py: the peak of the bytes made within a
step) never holds. A storage's resize is no op either: ZeRO-3 frees and refills its
parameters that way, through model/regions.py's `resize_storage`, which tells this mode the
storage's new size (`storage_resized`): a fact about the storage, not a category.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_leaves

from .memory import CountsMade


class LiveBytes(CountsMade):
    """Bytes of the storages made under this mode (on this thread) and alive now; inside a
    fused region only what it leaves (`CountsMade`)."""

    def __init__(self):
        super().__init__()
        self.live = 0  # bytes alive now
        self.peak = 0  # the most alive at once since reset_peak
        self._sizes: dict = {}  # storage id -> bytes, for the storages alive now
        self._states: set = set()  # storage ids of model states made in the step (`model_state`), alive
        self._recent: set = set()  # storage ids counted since `reset_peak`

    def reset_peak(self) -> None:
        self.peak = self.live
        self._recent.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made(t)
        return out

    def model_state(self, t: torch.Tensor) -> None:
        """`t`'s storage is a model state (a parameter's `.grad`, which the memory tracker
        counts with the model states however late it is made): not counted from now on, where
        it was made since `reset_peak` (one alive before is the baseline's: a DDP bucket)."""
        s = t.untyped_storage()
        sid = s._cdata
        if sid in self._states or (sid in self._sizes and sid not in self._recent):
            return
        self._states.add(sid)
        self.live -= self._sizes.pop(sid, 0)
        weakref.finalize(s, self._states.discard, sid)

    def _count(self, s: torch.UntypedStorage) -> None:
        sid = s._cdata
        if sid in self._sizes or sid in self._states:
            return
        n = s.nbytes()
        self._sizes[sid] = n
        self._recent.add(sid)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(s, self._freed, sid)

    def storage_resized(self, storage) -> None:
        """A counted storage now holds storage.nbytes() (model/regions.py, `resize_storage`:
        ZeRO-3's parameters freed and gathered again)."""
        sid = storage._cdata
        if sid in self._sizes:
            n = storage.nbytes()
            self.live += n - self._sizes[sid]
            self._sizes[sid] = n
            self.peak = max(self.peak, self.live)

    def _freed(self, sid: int) -> None:
        n = self._sizes.pop(sid, None)  # (None: a model state since, no longer counted)
        if n is not None:
            self._recent.discard(sid)
            self.live -= n
