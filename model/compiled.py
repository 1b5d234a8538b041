"""Chains of small ops that a GPU runs through torch.compile (Inductor fuses them into a few
kernels, and their host cost is one call instead of one per op), where the CPU, the meta
device (plans) and the float64 check run them op by op, the same arithmetic in another
number of kernels. The compiled function is made once per Python function, on first use,
without dynamic shapes (each shape it meets is compiled once).

A compiled region is compiled both ways: AOTAutograd (Ansel et al. 2024, "PyTorch 2") traces
its backward too, which a GPU runs as one compiled graph launched from one call. A plan runs
the region on the meta device as AOTAutograd's two graphs, op by op (`partitioned`), and
prices it as the GPU runs it (`region`): its forward as one kernel moving the bytes the
caller gives (`fused_kernel`), keeping for backward what the graphs' partition saves, its
backward as the kernels of one graph, each op's device time its own and the host's one call
(`compiled_kernels`), where an eager backward would cost the host one launch per op."""
from __future__ import annotations

import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from .region_timer import region_timer
from .regions import compiled_kernels, fused_kernel, inlined


@functools.cache
def compiled(fn):
    """`fn` through torch.compile."""
    return torch.compile(fn, dynamic=False)


def as_dtype(t, dtype):
    """`t` in `dtype`: `t` itself where it is in it already, without the `.to()` that would
    return it. torch 2.11's Dynamo differentiates an autograd.Function whose forward returns
    such a no-op `.to()` of one of its own results wrongly (`--compile` on float32 or float64:
    the gradients of every layer below it, up to 100% off; torch 2.13 does not), so the
    Functions traced into a compiled block (FusedRMSNorm, ScaledCausalSoftmax: model/gpt.py;
    ring attention's: sequence_parallel/ring.py) cast only what changes dtype."""
    return t if t.dtype == dtype else t.to(dtype)


def fused_on(fn, t):
    """`fn` as it runs on `t`'s device: compiled on CUDA, op by op elsewhere; as it is inside
    code torch.compile traces already (`--compile`: traced into the caller's graph)."""
    return compiled(fn) if t.is_cuda and not torch.compiler.is_compiling() else fn


def region(name: str, io_bytes: int, fn, *args, checkpointed: bool = False, graph=None, optimizer: bool = False):
    """fn(*args) as a GPU runs it: compiled on CUDA (`fused_on`); priced by the simulator as
    one kernel moving io_bytes (a plan's meta ranks, and CPU ranks with simulated time, run
    its ops one by one); on the meta device with the tensors saved for backward and the
    backward a compiled region has (`partitioned`), inside an activation-checkpointed block
    too, where a GPU runs the compiled region in the forward, again in the recomputation and
    its compiled backward after (torch's checkpoint recomputes the region's autograd Function
    as it does any op of the block); elsewhere op by op (the CPU's arithmetic, the float64
    check's included, left as it is). `graph`: the call site's CUDA graphs
    (model/cuda_graphs.py), which replay the compiled region on a GPU, outside a
    checkpointed block (`checkpointed`: a replay rewrites the outputs the checkpoint would
    keep). On CUDA under `timing_regions` (model/region_timer.py) the host's time in its call
    and in its backward is timed. `optimizer`: the region is an optimizer's pass
    (`fused_kernel`)."""
    t = args[0]
    with fused_kernel(io_bytes, name, graph=True, optimizer=optimizer):
        if t.is_meta and torch.is_grad_enabled():
            return partitioned(fn, name, *args)
        if graph is not None and t.is_cuda and not checkpointed:
            call = functools.partial(graph, fn, *args)
        else:
            call = functools.partial(fused_on(fn, t), *args)
        timer = region_timer() if t.is_cuda else None  # (elsewhere its ops run one by one)
        return call() if timer is None else timer.timed(name, call)


def partitioned(fn, name: str, *args):
    """fn(*args) on meta tensors as AOTAutograd runs a compiled region (Ansel et al. 2024,
    "PyTorch 2": the joint forward and backward graph cut in two by the min-cut
    rematerialization partitioner Inductor uses, torch's
    `functorch.compile.min_cut_rematerialization_partition`): its forward keeps for backward
    only the tensors the cut saves (a GPU recomputes the cheap elementwise rest inside its
    backward kernels), where an eager autograd graph keeps every op's saved inputs (1b-moe:
    117 MiB a layer more); its backward runs inside `compiled_kernels` (each op's device time
    its own, the host's one call), what it recomputes `inlined`. Traced once per function,
    name and argument signature (shapes, strides, dtypes, devices, whether each needs a
    gradient, the values of the others), on a thread of its own (`_tracer`), out of the
    simulator's sight; the two graphs then run here under `_Partitioned`, which saves what
    the cut saves through autograd's saved-tensor hooks (the memory tracker's count:
    AOTAutograd's own runtime keeps some of them past the hooks)."""
    graphs = _tracer().submit(_traced, fn, name, tuple(_signature(a) for a in args)).result()
    outs = _Partitioned.apply(graphs, *(a for a in args if isinstance(a, torch.Tensor)))
    return tree_unflatten(list(outs), graphs.structure)


_TENSOR = "tensor"


def _signature(a) -> tuple:
    """What a trace of a region depends on in one argument."""
    if isinstance(a, torch.Tensor):
        return (_TENSOR, tuple(a.shape), a.stride(), a.dtype, a.device.type, a.requires_grad)
    return (None, a)


def _tracer() -> ThreadPoolExecutor:
    """The one thread every trace of this process runs on, one at a time: a plan's ranks run
    in threads of one process, tracing is not thread-safe, and torch 2.11 (a CUDA build on a
    machine without a GPU) crashes tracing on a thread after another thread that traced has
    ended."""
    return _tracer_of(os.getpid())


@functools.cache
def _tracer_of(pid: int) -> ThreadPoolExecutor:
    """(One per process: a forked child has the parent's executor but not its thread.)"""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="region-tracer")


@dataclasses.dataclass
class _Graphs:
    """A region's forward and backward graphs (AOTAutograd's partition of its joint graph)."""
    name: str
    forward: torch.fx.GraphModule  # tensor arguments -> (outputs..., saved...)
    backward: torch.fx.GraphModule | None  # (saved..., a gradient per differentiable output) -> argument gradients
    recomputed: frozenset  # the backward's nodes that take no gradient: the forward's ops it recomputes
    differentiable: tuple  # per output: whether it has a gradient
    structure: TreeSpec  # how the outputs nest in what fn returns


@functools.cache
def _traced(fn, name: str, spec: tuple) -> _Graphs:
    """`fn`'s graphs at the arguments `spec` describes, as functions of its tensor arguments
    (the others bound): traced by aot_function on stand-ins, its backward graph made by one
    backward, the simulator's dispatch modes off."""
    where = [i for i, s in enumerate(spec) if s[0] == _TENSOR]

    def bound(*tensors):
        args = [s[1] for s in spec]
        for i, t in zip(where, tensors):
            args[i] = t
        return fn(*args)

    graphs = {}

    def keep(kind):
        def compiler(gm, _):
            graphs[kind] = gm
            return make_boxed_func(gm)
        return compiler

    traced = aot_function(bound, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                          partition_fn=min_cut_rematerialization_partition)
    # (on the tracer's thread no rank's dispatch modes or saved-tensor hooks are on; off here
    # all the same, whatever thread runs it)
    with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
        stand_ins = [torch.empty_strided(s[1], s[2], dtype=s[3], device=s[4]).requires_grad_(s[5])
                     for s in spec if s[0] == _TENSOR]
        outs, structure = tree_flatten(traced(*stand_ins))
        differentiable = tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in outs)
        needing = [t for t in stand_ins if t.requires_grad]
        if any(differentiable) and needing:  # (the backward graph is compiled at its first call)
            torch.autograd.grad([o for o, d in zip(outs, differentiable) if d], needing,
                                [torch.empty_like(o) for o, d in zip(outs, differentiable) if d], allow_unused=True)
    fw, bw = graphs["forward"], graphs.get("backward")
    returned = [getattr(n, "name", n) for n in next(n for n in fw.graph.nodes if n.op == "output").args[0]]
    saved = [] if bw is None else [n.name for n in bw.graph.nodes
                                   if n.op == "placeholder" and not n.name.startswith("tangents")]
    if returned[len(outs):] != saved:
        raise RuntimeError(f"region {name}: its traced forward returns {returned}, not its {len(outs)} outputs and the "
                           f"{len(saved)} tensors its backward takes ({saved}): an input mutated?")
    return _Graphs(name, fw, bw, _recomputed(bw), differentiable, structure)


def _same(t):
    return t


def _recomputed(bw) -> frozenset:
    """The nodes of a backward graph that depend on no gradient (tangent): the forward's ops
    it recomputes from what was saved, which the min-cut partitioner allows only for ops
    Inductor fuses into their consumers (pointwise ones, views, cheap reductions; never a
    matmul)."""
    if bw is None:
        return frozenset()
    on_gradients = set()
    for n in bw.graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or \
                any(a in on_gradients for a in n.all_input_nodes):
            on_gradients.add(n)
    return frozenset(n.name for n in bw.graph.nodes if n.op == "call_function" and n not in on_gradients)


class _Backward(torch.fx.Interpreter):
    """A backward graph run node by node, its recomputed nodes `inlined` (fused into the
    kernels that consume them, as Inductor compiles them)."""

    def __init__(self, graphs: _Graphs):
        super().__init__(graphs.backward)
        self.recomputed = graphs.recomputed

    def run_node(self, n):
        if n.name in self.recomputed:
            with inlined():
                return super().run_node(n)
        return super().run_node(n)


class _Partitioned(torch.autograd.Function):
    """A region's two graphs run as one autograd node: the forward saves what the partition
    saves; the backward runs the backward graph inside `compiled_kernels`."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, *tensors):
        got = graphs.forward(*tensors)
        n = len(graphs.differentiable)
        outs, saved = tuple(got[:n]), got[n:]
        ctx.save_for_backward(*saved)
        ctx.graphs, ctx.n_args = graphs, len(tensors)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, graphs.differentiable)
                                      if isinstance(o, torch.Tensor) and not d])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        graphs = ctx.graphs
        if graphs.backward is None:
            return (None,) * (1 + ctx.n_args)
        tangents = [g for g, d in zip(grads, graphs.differentiable) if d]
        # (unpacked before the compiled graph: inside an activation-checkpointed block the
        # first unpack recomputes the block, whose ops a GPU launches one by one, its compiled
        # regions' forwards among them, before the AOTAutograd backward's one call)
        saved = ctx.saved_tensors
        with compiled_kernels(f"{graphs.name}_backward"):
            got = _Backward(graphs).run(*saved, *tangents)
        return (None, *got)
