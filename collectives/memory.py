"""Memory of one simulated rank by category (DESIGN.md, Contract 3): parameters,
gradients, optimizer states, activations saved for backward, communication buffers;
current and peak.

Model states are measured from the tensors themselves (each storage counted once, so
DDP's gradient views into its buckets count as the buckets): `MemoryTracker.model_states`
gives exactly the bytes those tensors hold. Activations are followed as autograd saves
them: a thread-local `saved_tensors_hooks` wraps each saved tensor in a handle that adds
its storage's bytes when saved and removes them when autograd frees it (the handle's
`__del__`), so the current and the peak bytes saved for backward are known at every
moment; parameters saved for backward (a matmul's weight) are not activations and are
skipped. Communication buffers are what a strategy registers (`comm_buffers`): none for
DDP, whose buckets are the gradients.
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes()) if t.device.type != "meta" else (id(s), s.nbytes())


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen = {}
    for t in tensors:
        if t is not None:
            k = _storage_key(t)
            seen[k] = k[1]
    return sum(seen.values())


class _Saved:
    __slots__ = ("tensor", "nbytes", "tracker")

    def __init__(self, tensor, nbytes, tracker):
        self.tensor, self.nbytes, self.tracker = tensor, nbytes, tracker
        tracker.activations += nbytes
        tracker.peak_activations = max(tracker.peak_activations, tracker.activations)

    def __del__(self):
        self.tracker.activations -= self.nbytes


class MemoryTracker:
    def __init__(self):
        self.activations = 0  # bytes saved for backward now
        self.peak_activations = 0
        self.comm_buffers = 0  # bytes a strategy holds for communication
        self._exclude: set = set()

    @contextlib.contextmanager
    def track_activations(self, exclude=()):
        """Count the tensors autograd saves inside this block (this thread only); the
        storages of `exclude` (the parameters) are not activations."""
        self._exclude = {_storage_key(t) for t in exclude}

        def pack(t):
            k = _storage_key(t)
            if k in self._exclude:
                return t
            return _Saved(t, k[1], self)

        def unpack(x):
            return x.tensor if isinstance(x, _Saved) else x

        with saved_tensors_hooks(pack, unpack):
            yield self

    @staticmethod
    def model_states(model, optimizer=None) -> dict:
        params = list(model.parameters())
        states = [v for st in (optimizer.state.values() if optimizer else []) for v in st.values()
                  if isinstance(v, torch.Tensor)]
        return {"parameters": storage_bytes(params),
                "gradients": storage_bytes(p.grad for p in params),
                "optimizer": storage_bytes(states)}

    def snapshot(self, model, optimizer=None) -> dict:
        """Bytes by category now, with the peak of the activations so far and the peak total
        (model states as now, plus the activations' peak and the communication buffers)."""
        out = self.model_states(model, optimizer)
        out["activations"] = self.activations
        out["peak_activations"] = self.peak_activations
        out["comm_buffers"] = self.comm_buffers
        out["peak_total"] = out["parameters"] + out["gradients"] + out["optimizer"] + self.peak_activations \
            + self.comm_buffers
        return out
