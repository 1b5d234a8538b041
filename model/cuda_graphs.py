"""A compiled region captured as CUDA graphs, one pair (forward, backward) per call site
(NVIDIA, "CUDA Graphs", CUDA C++ Programming Guide; torch.cuda.make_graphed_callables'
partial-network capture, as Megatron-Core and Transformer Engine capture each layer): the
host launches a layer's forward with one replay instead of one call per kernel, and its
backward with another. A MoE layer's compiled region is a chain of some 25 small kernels
between the router and the experts' grouped GEMMs, whose launches cost a GPU's host more
than the device takes to run them (benchmarks/results/gpu/run39_moe_sorts: 1.9 ms of host
for 0.84 ms of device per forward call, under the profiler).

How a site runs (`GraphedRegion`): its first `warmup` calls run the compiled region as it
is (torch.compile traces and compiles it then, forward and backward); the next call
captures its forward (the inputs that are not weights copied into static tensors first),
and that call's backward captures its backward; every later call copies its inputs in,
replays the forward, and in its backward copies the output gradients in and replays that.
Weights, and buffers that need no gradient (the balancing bias), are read where they lie:
the graph holds their addresses, so they must be updated in place (AdamW does, ZeRO's
compute copies do) and never moved (ZeRO-3's gathers move them: not graphed).

All sites of a model share one memory pool (`CudaGraphs`), which is safe only when the
replays run in the order of the captures, as one step of plain gradient accumulation runs
them: every layer's forward in turn, then the backwards in reverse (the condition of
torch.cuda.make_graphed_callables on callables sharing a pool). A pipeline's schedule,
which interleaves microbatches, and activation checkpointing, which runs a forward again
inside the backward, break that order: their runs are refused (`playground/run_config.py`).

What a forward writes holds until the next replay of the same site: outputs a caller keeps
longer (the routing statistics, kept until the step's report) are copied out (`keep`).
What a backward writes holds only until the next forward replay of any site: the compiled
backward may write its gradients into buffers its forward saved (Inductor's donated
buffers), and its capture may have taken memory another site's forward had freed, both of
which that forward's next replay rewrites. So an argument's gradient that is not a weight's
is handed out as a copy (an activation's, a few MiB), and a weight's as the buffer itself
(lent): autograd adds it into the weight's gradient where there is one, and takes the
buffer as the gradient where there is none (it takes a gradient nothing else holds); such
a gradient is copied out before the next replay (`CudaGraphs.reclaim`), so accumulation
over microbatches adds what it should, and a step of one microbatch copies nothing.

CPU, meta and the float64 check never graph: the site runs the region as `fused_on` does.
`graph` picks how a capture is made: `torch.cuda.CUDAGraph` on a GPU, or for tests an
emulation that runs the captured Python again at each replay, writing into the first run's
outputs as a replay writes into the captured buffers, and filling every backward's outputs
with NaN at each forward replay, as that replay may (`Emulated`)."""
from __future__ import annotations

import torch

from .compiled import compiled


class CudaGraphs:
    """The CUDA graphs of one model's regions: their shared memory pool, the number of
    plain calls a site makes before it captures, how a capture is made (`graph`) and how
    a region is compiled (`compile`: torch.compile; tests may run it as it is)."""

    def __init__(self, warmup: int = 1, graph=None, compile=None):
        self.warmup = warmup
        self.graph = graph or _CudaGraph
        self.compile = compile or compiled
        self.pool = None  # the memory pool of every capture (made at the first)
        self.lent = []  # (weight, buffer): weights' gradients handed to autograd as a backward's buffers
        self.backward_outputs = []  # every captured backward's outputs (what a forward replay may rewrite)

    def site(self, keep: tuple = ()) -> "GraphedRegion":
        """A new call site (one layer's region); `keep`: the outputs its caller holds past the
        next call, copied out of the graph's buffers at each replay."""
        return GraphedRegion(self, keep)

    def reclaim(self) -> None:
        """Before a replay: a weight's gradient that autograd took as a backward's buffer
        itself, copied out of it (the replay may rewrite it)."""
        for weight, buffer in self.lent:
            if weight.grad is not None and weight.grad.data_ptr() == buffer.data_ptr():
                weight.grad = weight.grad.clone()
        self.lent.clear()

    def before_forward(self) -> None:
        """Before a forward replay, which may rewrite every backward's outputs (the module's
        docstring)."""
        self.reclaim()
        self.graph.rewrites(self.backward_outputs)


class _CudaGraph:
    """One capture on the GPU: `capture(body)` records the kernels body() launches (and
    returns what it returns: tensors in the pool, written at each replay); `replay()`."""

    def __init__(self, graphs: CudaGraphs):
        self.graphs, self.graph = graphs, torch.cuda.CUDAGraph()

    def capture(self, body):
        if self.graphs.pool is None:
            self.graphs.pool = torch.cuda.graph_pool_handle()
        # thread_local: the backward is captured on autograd's device thread, while other
        # threads (NCCL's watchdog) may query their events
        with torch.cuda.graph(self.graph, pool=self.graphs.pool, capture_error_mode="thread_local"):
            return body()

    runs_python = False

    def replay(self) -> None:
        self.graph.replay()

    @staticmethod
    def rewrites(outputs) -> None:
        """What a forward replay does to the backwards' `outputs`: the GPU writes there what
        it writes; nothing to do."""


class Emulated:
    """A capture emulated on any device (tests): body() runs at the capture, and again at
    each replay, its tensors copied into the first run's, as a replay rewrites the captured
    buffers."""

    runs_python = True

    def __init__(self, graphs: CudaGraphs):
        self.body = self.first = None

    def capture(self, body):
        self.body = body
        self.first = body()
        return self.first

    def replay(self) -> None:
        with torch.enable_grad():  # (a forward replay runs inside autograd's Function)
            new = self.body()
        with torch.no_grad():
            for old, t in zip(_tensors(self.first), _tensors(new)):
                old.copy_(t)

    @staticmethod
    def rewrites(outputs) -> None:
        """A forward replay's worst on the backwards' `outputs` it may share memory with: NaN."""
        with torch.no_grad():
            for t in _tensors(outputs):
                if t.is_floating_point():
                    t.fill_(float("nan"))


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for v in x for t in _tensors(v)] if isinstance(x, (tuple, list)) else []


def _read_in_place(a) -> bool:
    """A weight, or a buffer that needs no gradient: the graph reads it where it lies."""
    return isinstance(a, torch.nn.Parameter) or (a.is_leaf and not a.requires_grad)


def _signature(args) -> tuple:
    """What a capture holds fixed: the non-tensor arguments by value, the tensors' shapes,
    dtypes, devices and whether they need a gradient, the weights' addresses, and autocast."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((tuple(a.shape), a.dtype, a.device, a.requires_grad,
                        a.data_ptr() if _read_in_place(a) else None))
        else:
            out.append(("value", a))
    kind = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) if kind in ("cuda", "cpu") else ()
    return tuple(out) + (autocast,)


class GraphedRegion:
    """One call site of a compiled region, graphed (see the module's docstring). Call it as
    the region: site(fn, *args); `fn` is the same function at every call."""

    def __init__(self, graphs: CudaGraphs, keep: tuple = ()):
        self.graphs, self.keep = graphs, keep
        self.calls = 0  # plain calls so far
        self.signature = None  # what the capture holds fixed
        self.off = None  # why this site no longer replays (its arguments changed since the capture)
        self.forward = self.backward = None  # the captures
        self.base = None  # the arguments as captured: copies of the activations, the weights themselves
        self.static = None  # what the capture read: leaves sharing the storage of `base`
        self.tensor_index = ()  # which arguments are tensors
        self.outputs = None  # the forward's outputs (detached), rewritten at each replay
        self.many = True  # the region returns a tuple
        self.differentiable = ()  # the outputs that have a gradient
        self.live = None  # those outputs of the captured forward, with their autograd graph
        self.wanted = ()  # the tensor arguments that need a gradient
        self.grad_outputs = None  # the backward's inputs, one per differentiable output
        self.written = None  # which of them hold a gradient (not zeros) since the last replay
        self.grad_inputs = None  # the backward's outputs, one per wanted argument

    def __call__(self, fn, *args):
        run = self.graphs.compile(fn)
        if self.off or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return run(*args)
        if self.forward is None:
            if self.calls < self.graphs.warmup:
                self.calls += 1
                return run(*args)
            self._capture(run, args)
        elif _signature(args) != self.signature:
            self.off = "its arguments changed since the capture"
            return run(*args)
        out = _Replay.apply(self, *[a for a in args if isinstance(a, torch.Tensor)])
        return out if self.many else out[0]

    def _capture(self, run, args) -> None:
        """Capture the forward, after one run of it and of its backward outside the capture,
        so that nothing compiles or initialises inside it. The capture reads fresh leaves:
        copies of the activations, and aliases of the weights (their storage), whose
        gradient accumulators are made inside the capture, on its stream: a weight's own
        accumulator, made on the default stream by earlier steps, would make that stream
        wait on the capture's, which a capture refuses."""
        self.signature = _signature(args)
        self.base = [a if not isinstance(a, torch.Tensor) or _read_in_place(a) else a.detach().clone() for a in args]
        self.tensor_index = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.wanted = tuple(i for i in self.tensor_index if args[i].requires_grad)

        def leaves():
            return [b.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                    for a, b in zip(args, self.base)]

        def body():
            out = run(*self.static)
            self.many = isinstance(out, tuple)
            outs = out if self.many else (out,)
            self.differentiable = tuple(j for j, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad)
            self.live = [outs[j] for j in self.differentiable]
            return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)  # (others: constants)
        self.static = leaves()
        body()
        if self.live and self.wanted:
            torch.autograd.grad(self.live, [self.static[i] for i in self.wanted],
                                [torch.zeros_like(o) for o in self.live], allow_unused=True)
        self.static = leaves()
        self.forward = self.graphs.graph(self.graphs)
        self.outputs = self.forward.capture(body)

    def copy_in(self, tensors) -> None:
        """The call's activations into the static inputs (the weights are read in place),
        through an alias that autograd does not version: the captured forward saved the
        static inputs, and the capture's own backward still checks their version."""
        for i, t in zip(self.tensor_index, tensors):
            s = self.static[i]
            if s is not t and s.data_ptr() != t.data_ptr():
                s.data.copy_(t)

    def run_backward(self, grads) -> list:
        """The gradients of the tensor arguments (None where none is needed) from those of
        the outputs (None where an output got none); the first call captures the backward."""
        if self.backward is None:
            self._capture_backward()
        for n, j in enumerate(self.differentiable):
            if grads[j] is not None:
                self.grad_outputs[n].copy_(grads[j])
                self.written[n] = True
            elif self.written[n]:
                self.grad_outputs[n].zero_()
                self.written[n] = False
        self.graphs.reclaim()
        self.backward.replay()
        out = dict(zip(self.wanted, self.grad_inputs))
        grads = []
        for i in self.tensor_index:
            g = out.get(i)
            if g is not None and isinstance(self.base[i], torch.nn.Parameter):
                self.graphs.lent.append((self.base[i], g))  # (a weight's: lent, see the module's docstring)
                g = g.detach()
            elif g is not None:
                g = g.clone()  # (an activation's: valid only until the next forward replay)
            grads.append(g)
        return grads

    def _capture_backward(self) -> None:
        self.grad_outputs = [torch.zeros_like(o) for o in self.live]
        self.written = [False] * len(self.live)
        self.backward = self.graphs.graph(self.graphs)

        def body():  # (an emulated replay runs this again, on the graph it keeps; a compiled backward
            # that donates its buffers takes no retained graph)
            return torch.autograd.grad(self.live, [self.static[i] for i in self.wanted], self.grad_outputs,
                                       retain_graph=self.backward.runs_python, allow_unused=True)
        self.grad_inputs = self.backward.capture(body)
        self.graphs.backward_outputs.append(self.grad_inputs)
        if not self.backward.runs_python:
            self.live = None  # the captured forward's autograd graph, and what it saved, go (the pool holds them)


class _Replay(torch.autograd.Function):
    """A site's forward replay, whose backward is the site's backward replay."""

    @staticmethod
    def forward(ctx, site, *tensors):
        site.copy_in(tensors)
        site.graphs.before_forward()
        site.forward.replay()
        ctx.site = site
        outs = tuple(o if not isinstance(o, torch.Tensor) else o.clone() if j in site.keep else o.detach()
                     for j, o in enumerate(site.outputs))
        ctx.mark_non_differentiable(*[o for j, o in enumerate(outs)
                                      if isinstance(o, torch.Tensor) and j not in site.differentiable])
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        return (None, *ctx.site.run_backward(grads))
