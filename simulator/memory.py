"""Memory of one simulated rank by category (docs/architecture.md, Contract 3): parameters,
gradients, optimizer states, activations saved for backward, communication buffers;
current and peak.

Model states are measured from the tensors themselves (each storage counted once, so
DDP's gradient views into its buckets count as the buckets): `MemoryTracker.model_states`
gives exactly the bytes those tensors hold. Activations are followed as autograd saves
them: a thread-local `saved_tensors_hooks` wraps each saved tensor in a handle that adds
its storage's bytes when the first tensor of that storage is saved and removes them when
autograd frees the last one (the handles' `__del__`): a storage saved by several ops, or
through several views, counts once, as it occupies memory once. So the current and the
peak bytes saved for backward are known at every moment; parameters saved for backward (a matmul's weight) are not activations and are
skipped. Backward's temporaries (the gradients in flight between autograd's nodes, and
what a node allocates while it runs: the cross-entropy's float32 gradients of the
logits, for one) are followed by a dispatch mode during backward: each new storage an op
makes there counts until the storage is freed (not its tensor: autograd hands a gradient
on in tensors of its own, and a collective in flight holds its input until waited), a
parameter's `.grad` excepted (a model state); in recomputation (activation checkpointing's
forward inside backward) what the ops make counts as activations while it lives (`watch`:
torch's checkpoint holds it outside the saved-tensor hooks). Code that keeps tensors
outside autograd (the pipeline executor, split backward's store, selective
checkpointing) holds them with `hold(t, category)`; a storage with several holders counts
once. Communication buffers are what a strategy registers (`comm_buffers`): none for
DDP, whose buckets are the gradients. simulator/live_bytes.py counts every storage the
rank's ops make, told nothing: the reference the tracker is audited against
(playground/memory_audit.py).
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode

from .scoped import scoped


def storage_id(t: torch.Tensor) -> int:
    """The identity of the storage behind `t`: the same for every view of it, and kept when
    the storage is resized (ZeRO-3 frees and refills its parameters that way)."""
    return t.untyped_storage()._cdata


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (their current size)."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


class _Saved:
    """A handle on a held tensor (`MemoryTracker.hold`): its storage counts while the handle
    lives (simulator/memory.py, `_join`)."""
    __slots__ = ("tensor", "key", "tracker", "category")

    def __init__(self, tensor, key, nbytes, tracker, category="activations"):
        self.tensor, self.key, self.tracker, self.category = tensor, key, tracker, category
        tracker._join(key, nbytes, category)

    def __del__(self):
        self.tracker._leave(self.key, self.category)


class MemoryTracker:
    def __init__(self):
        self.activations = 0  # bytes saved for backward now
        self.peak_activations = 0
        self.comm_buffers = 0  # bytes a strategy holds for communication now
        self.peak_comm_buffers = 0
        self.temporaries = 0  # bytes of backward's temporaries alive now
        self.peak_temporaries = 0
        # gradients a strategy allocates in backward and frees at its optimizer step (ZeRO-2/3's
        # shards, as FSDP2's after zero_grad(set_to_none=True)), alive now
        self.step_gradients = 0
        self.peak_step_gradients = 0
        self.peak_transient = 0  # the peak of activations, buffers, temporaries and step gradients together
        self.at_peak = (0, 0, 0, 0)  # what that peak held: (activations, buffers, temporaries, step gradients)
        self._exclude: set = set()
        self._temporary: dict = {}  # storage id -> (bytes, the finalizer that stops counting a temporary)
        self._held: dict = {}  # storage id -> [bytes, {category: holders}, the category it counts in]
        self._watched: set = set()  # storage ids counted until the storage is freed (`watch`)
        self.tracking = False  # inside track_activations

    def hold(self, t: torch.Tensor, category: str = "activations"):
        """A handle that counts `t`'s storage in `category` ("activations", or "comm_buffers":
        a pipeline's received gradients and its sends' tensors) for as long as it lives (None
        for a parameter's). Autograd's saved tensors get one each; activation checkpointing
        gives one to each output its selective policy keeps outside autograd; the pipeline
        executor to the tensors it keeps between its actions (pipeline/executor.py)."""
        s = t.untyped_storage()
        if s._cdata in self._exclude:
            return None
        self.claim(t)  # (a tensor made in backward and kept on: counted here, not as a temporary too)
        # detached: holding the tensor itself would tie a saved output to its own grad_fn, a
        # reference cycle that keeps a retained graph alive until the garbage collector runs
        return _Saved(t.detach(), s._cdata, s.nbytes(), self, category)

    def watch(self, t: torch.Tensor, category: str = "activations") -> None:
        """Count `t`'s storage in `category` until the storage itself is freed, keeping nothing
        alive: what a recomputation makes, held by torch.utils.checkpoint outside the
        saved-tensor hooks (activation_checkpointing/checkpoint.py)."""
        self.watch_storage(t.untyped_storage(), category)

    def watch_storage(self, s: torch.UntypedStorage, category: str = "activations") -> None:
        """`watch` of a storage itself (what a fused region leaves, `CountsMade`)."""
        if s._cdata in self._exclude or s.nbytes() == 0:
            return
        key = s._cdata
        self._claim(key)
        if key in self._watched:
            return
        self._watched.add(key)
        self._join(key, s.nbytes(), category)
        weakref.finalize(s, self._unwatch, key, category)

    def _unwatch(self, key, category: str) -> None:
        self._watched.discard(key)
        self._leave(key, category)

    def _join(self, key, nbytes: int, category: str) -> None:
        """One more holder of storage `key`: several ops saving the same tensor (or views of
        one storage), a pipeline holding a stage's output that autograd saved too, hold its
        bytes once, until the last of them lets go. The bytes count in the category of a
        holder still holding them ("activations" or "comm_buffers"): a stage's output counts
        as an activation until its backward, then as a buffer while its send still holds it."""
        held = self._held
        if key in held:
            counts = held[key][1]
            counts[category] = counts.get(category, 0) + 1
            return
        held[key] = [nbytes, {category: 1}, category]
        self._add(category, nbytes)

    def _leave(self, key, category: str) -> None:
        entry = self._held[key]
        nbytes, counts, counted_in = entry
        counts[category] -= 1
        if counts[category] == 0:
            del counts[category]
        if not counts:
            del self._held[key]
            self._add(counted_in, -nbytes)
        elif counted_in not in counts:  # (its bytes move to a category still holding them)
            entry[2] = next(iter(counts))
            self._add(counted_in, -nbytes)
            self._add(entry[2], nbytes)

    def _add(self, category: str, nbytes: int) -> None:
        """Count nbytes (< 0: stop counting them) of held storages in `category`."""
        if category == "activations":
            self.activations += nbytes
            self.peak_activations = max(self.peak_activations, self.activations)
            self._transient_changed()
        else:
            self.buffer(nbytes)

    @property
    def transient(self) -> int:
        """Bytes held now beyond the model states: activations, buffers, temporaries, step gradients."""
        return self.activations + self.comm_buffers + self.temporaries + self.step_gradients

    def _transient_changed(self) -> None:
        now = self.transient
        if now > self.peak_transient:
            self.peak_transient = now
            self.at_peak = (self.activations, self.comm_buffers, self.temporaries, self.step_gradients)

    def temporary(self, s: torch.UntypedStorage) -> None:
        """Count storage `s` (made by an op in backward) until it is freed (the storage, not a
        tensor: autograd passes a gradient on in tensors of its own, and a view keeps it)."""
        nbytes = s.nbytes()
        if nbytes == 0:
            return
        self.temporaries += nbytes
        self.peak_temporaries = max(self.peak_temporaries, self.temporaries)
        self._transient_changed()
        sid = s._cdata
        self._temporary[sid] = (nbytes, weakref.finalize(s, self._temporary_freed, sid, nbytes))

    def _temporary_freed(self, sid: int, nbytes: int) -> None:
        self.temporaries -= nbytes
        entry = self._temporary.get(sid)
        if entry is not None and not entry[1].alive:  # (its own entry, not a later tensor's at the same address)
            del self._temporary[sid]

    def claim(self, t: torch.Tensor) -> None:
        """A strategy counts `t` (made in backward) in a category of its own (`buffer`,
        `gradients`): it is no longer a temporary."""
        self._claim(storage_id(t))

    def _claim(self, sid: int) -> None:
        entry = self._temporary.pop(sid, None)
        if entry is not None and entry[1].detach() is not None:  # (not yet freed)
            self.temporaries -= entry[0]

    def buffer(self, nbytes: int) -> None:
        """A strategy allocated (nbytes > 0) or freed (< 0) a communication buffer (ZeRO's
        gathered parameters and in-flight gradients)."""
        self.comm_buffers += nbytes
        self.peak_comm_buffers = max(self.peak_comm_buffers, self.comm_buffers)
        self._transient_changed()

    def gradients(self, nbytes: int) -> None:
        """A strategy allocated (nbytes > 0) or freed (< 0) gradients that live from backward
        to its optimizer step (not model states held through the forward)."""
        self.step_gradients += nbytes
        self.peak_step_gradients = max(self.peak_step_gradients, self.step_gradients)
        self._transient_changed()

    @contextlib.contextmanager
    def track_activations(self, exclude=()):
        """Count the tensors autograd saves inside this block (this thread only); the
        storages of `exclude` (the parameters) are not activations, and a gradient autograd
        leaves in one of them (`.grad`) is a model state, not a temporary."""
        exclude = list(exclude)
        self._exclude = {storage_id(t) for t in exclude}
        hooks = [p.register_post_accumulate_grad_hook(self._grad_accumulated)
                 for p in exclude if isinstance(p, torch.Tensor) and p.is_leaf and p.requires_grad]

        def pack(t):
            handle = self.hold(t)
            return t if handle is None else handle

        def unpack(x):
            return x.tensor if isinstance(x, _Saved) else x

        self.tracking = True
        try:
            with saved_tensors_hooks(pack, unpack), _BackwardTemporaries(self):
                yield self
        finally:
            self.tracking = False
            for h in hooks:
                h.remove()

    def _grad_accumulated(self, p) -> None:
        if p.grad is not None:
            self.claim(p.grad)

    @staticmethod
    def measure(tensors: dict) -> dict:
        """Bytes by category of {category: [tensors]} (each storage once per category); a
        category given as a number of bytes (what tensors freed since then held) is kept."""
        return {k: v if isinstance(v, int) else storage_bytes(v) for k, v in tensors.items()}

    @staticmethod
    def model_states(model, optimizer=None) -> dict:
        params = list(model.parameters())
        states = [v for st in (optimizer.state.values() if optimizer else []) for v in st.values()
                  if isinstance(v, torch.Tensor)]
        return {"parameters": storage_bytes(params),
                "gradients": storage_bytes(p.grad for p in params),
                "optimizer": storage_bytes(states)}

    def snapshot(self, model=None, optimizer=None, states: dict | None = None) -> dict:
        """Bytes by category now (model states measured from `model` and `optimizer`, or as a
        strategy reports them in `states`), with the peaks so far of the activations and the
        communication buffers, and the peak total: model states as now plus the peak of
        activations, communication buffers, temporaries and step gradients held together,
        and `at_peak`: that total by category at the moment of its peak. "gradients" adds the peak of the step gradients to those held now (ZeRO-2/3 free
        theirs at the step: a report after it still shows what backward made)."""
        out = dict(states) if states is not None else self.model_states(model, optimizer)
        held = out["gradients"]
        out["gradients"] = held + self.peak_step_gradients
        out["activations"] = self.activations
        out["peak_activations"] = self.peak_activations
        out["comm_buffers"] = self.comm_buffers
        out["peak_comm_buffers"] = self.peak_comm_buffers
        out["peak_temporaries"] = self.peak_temporaries
        out["peak_total"] = out["parameters"] + held + out["optimizer"] + self.peak_transient
        activations, buffers, temporaries, step_gradients = self.at_peak
        # the peak total by category at the moment of the peak: the parts sum to it (the
        # table and the plots draw this one split)
        out["at_peak"] = {"parameters": out["parameters"], "gradients": held + step_gradients,
                          "optimizer": out["optimizer"], "activations": activations,
                          "temporaries": temporaries, "comm_buffers": buffers}
        return out


def _tensors(x):
    """The tensors in x, at any depth of lists and tuples (an op's arguments or outputs)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


class CountsMade(TorchDispatchMode):
    """A dispatch mode that counts the storages ops make (`made`, which subclasses call and
    `_count` counts), except inside a fused region (`fused`: ops a GPU runs as one kernel,
    model/regions.py), whose intermediate tensors never exist on the GPU: only the storages
    the region made that are alive at its end (its outputs, and what autograd saved from
    it) count, from then on. Storages, not tensors: what autograd saves in a recomputation
    (torch.utils.checkpoint) is a detached view of the op's output, whose own tensor is
    gone by the region's end while its storage lives on."""

    def __init__(self):
        super().__init__()
        self._made = None  # inside a fused region: weak references to the storages its ops made
        self._inlined = False  # inside `inlined`

    def made(self, t: torch.Tensor) -> None:
        if self._inlined:
            return
        if self._made is None:
            self._count(t.untyped_storage())
        else:
            self._made.append(weakref.ref(t.untyped_storage()))

    def _count(self, s: torch.UntypedStorage) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def inlined(self):
        """What the ops inside make is never counted: it exists only inside the kernels that
        consume it (model/regions.py, `inlined`)."""
        with scoped(self, "_inlined", True):
            yield self

    @contextlib.contextmanager
    def fused(self, io_bytes: int = 0, name: str = "fused", **_):
        if self._made is not None:  # nested: part of the outer region
            yield self
            return
        self._made = []
        try:
            yield self
        finally:
            made, self._made = self._made, None
            seen = set()
            for ref in made:
                s = ref()
                if s is not None and s._cdata not in seen:
                    seen.add(s._cdata)
                    self._count(s)


class _BackwardTemporaries(CountsMade):
    """During backward (an autograd node running), every op's output on a storage none of its
    inputs has is a temporary of the tracker's, or in a recomputation (gradients on) an
    activation while its storage lives (`_count`); inside a fused region only what it leaves
    (`CountsMade`)."""

    def __init__(self, tracker: MemoryTracker):
        super().__init__()
        self.tracker = tracker

    @property
    def activation_tracker(self) -> MemoryTracker:
        """The tracker, to code that keeps activations outside autograd (model.regions)."""
        return self.tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or torch._C._current_autograd_node() is None:
            return out
        inputs = {storage_id(t) for t in _tensors((args, tuple((kwargs or {}).values())))}
        for t in _tensors(out):
            if storage_id(t) not in inputs:
                self.made(t)
        return out

    def _count(self, s: torch.UntypedStorage) -> None:
        """A storage an op made in backward: a temporary; in a recomputation (gradients on:
        a checkpointed block's forward run again), an activation for as long as it lives,
        since torch.utils.checkpoint keeps what the block saves outside the hooks."""
        if torch.is_grad_enabled():
            self.tracker.watch_storage(s)
        else:
            self.tracker.temporary(s)
