"""Modelled compute time of the torch ops a simulated rank runs (docs/architecture.md, Contract 3).

A `TorchDispatchMode` pushed in the rank's thread (the dispatch-mode stack is
thread-local, so each rank counts only its own ops, backward included) sees every aten
op. Host and device are two queues, as in an eager GPU run: the host spends the kernel
floor issuing each op (Python, dispatch and launch), the device runs it when it has been
issued and the previous one is done, for max(FLOPs / FLOP rate, bytes / (HBM bandwidth ·
HBM fraction)), a 16-bit matmul's FLOP time in whole tiles and whole waves of tiles
over the GPU's SMs where the profile gives them (Hardware.wave_quantization: NVIDIA's
"Matrix Multiplication Background User's Guide"), fused attention at the profile's
fraction for its head dimension and sequence (Hardware.attention_fraction_at), at the speed
of the kernels' generation relative to the profile's (`FLASH_GENERATIONS`, set for a step
by `attention_kernels`). So the host runs ahead while kernels are long (the step is the device's
work) and the device starves while they are short (the step is the host's issuing); a
read of a value on the host (`.item()`, `.tolist()`) makes the host wait for the device.
FLOPs from torch's own flop counter formulas (matmuls, convolutions, attention), bytes =
its tensor inputs and outputs read and written once; views move nothing and launch
nothing, and neither do allocations that write nothing (empty, empty_like, ...), ops on
empty tensors or on none, copies between devices (the copy engines move them, beside the
kernels: host-to-device index copies, which a run on the CPU does not make) and reads of
a scalar to the host (`.item()`). The FLOP rate is the op's: fused attention kernels at
the attention fraction of the bf16 peak; other ops at the matmul fraction of the bf16 peak
when their inputs are 16-bit, of the FP32 peak otherwise (torch runs float32 matmuls
without TF32 by default). This is the roofline model (Williams, Waterman & Patterson
2009) per op behind a host that issues one op per floor. Ops are not fused unless the
code says a GPU runs them as one kernel (`fused`: FlashAttention's blocks, the RMSNorm
kernels), so chains of elementwise ops that a compiler would fuse are overestimated. An
optimizer step runs as the fused AdamW kernel torch uses on GPUs: one pass reading
parameters, gradients and both moments and writing back all but the gradients
(`optimizer_step`).

On meta tensors (plans) the outputs of common pointwise ops and reductions are made
directly, without torch's meta kernels (`_on_meta`): their Python references took half of
a plan's time.

`step(mode)` brackets one training step for the clock's record and replay (see
clock.py): a replayed step runs with this mode popped, so its ops cost nothing to run
and its compute is the recorded step's.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _get_current_dispatch_mode,
                                          _get_current_dispatch_mode_stack, _pop_mode_temporarily)
from torch.utils.flop_counter import flop_registry

from .clock import RankClock
from .hardware import Hardware
from .scoped import scoped


def _shapes(x):
    """x with every tensor in it (at any depth of lists and tuples) replaced by its shape:
    what torch's FLOP formulas take."""
    if isinstance(x, torch.Tensor):
        return x.shape
    if isinstance(x, (list, tuple)):
        return type(x)(_shapes(y) for y in x)
    return x


def _nbytes(values) -> int:
    n = 0
    for x in values:
        if isinstance(x, torch.Tensor):
            n += x.numel() * x.element_size()
        elif isinstance(x, (list, tuple)):
            n += _nbytes(x)
    return n


# allocate without reading or writing memory, or read a scalar to the host
_FREE = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
         torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten._local_scalar_dense,
         torch.ops.aten._unsafe_view}  # (_unsafe_view: a view torch does not mark as one)
# copies: kernels on one device, copy-engine transfers between two
_COPIES = {torch.ops.aten._to_copy, torch.ops.aten.copy_}
_TRANSFER = "transfer"

# FLOP formulas torch's counter lacks: the CPU flash attention that scaled_dot_product_attention
# dispatches to on CPU takes the same (q, k, v, ...) and (grad, q, k, v, out, lse, ...) arguments
# as the CUDA flash kernels, and does the same work
_ALIASES = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: torch.ops.aten._scaled_dot_product_flash_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        torch.ops.aten._scaled_dot_product_flash_attention_backward,
}
# where those flash kernels take is_causal: a causal kernel skips the tiles above the
# diagonal (Dao 2023, FlashAttention-2, section 3.1.1), so it does (s + 1) / (2s) of the
# full s² work the formula counts
_CAUSAL_ARG = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: 4,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: 7}


# fused attention kernels (priced at the profile's attention fraction)
_ATTENTION = {getattr(torch.ops.aten, name) for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
    "_efficient_attention_forward", "_efficient_attention_backward") if hasattr(torch.ops.aten, name)} | set(_ALIASES)
_HALF = (torch.bfloat16, torch.float16)
# the speed of each generation of flash kernels relative to the profile's attention rates,
# which are FlashAttention-2's (the A100's from its paper, the H100's and H200's measured on
# today's kernels): FlashAttention-2 is "around 2x" faster than FlashAttention, which reaches
# 25-40% of the A100's peak against its 50-73% (Dao 2023, FlashAttention-2, abstract)
FLASH_GENERATIONS = {"flash": 1.0, "flash1": 0.5}
# a region whose ops run as separate kernels back to back, launched by one host call (`compiled`)
_BACK_TO_BACK = "back to back"
# matmuls whose output is tiled (the profile's wave quantization)
_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm}


def _first_dtype(args):
    for x in args:
        if isinstance(x, torch.Tensor):
            return x.dtype
    return None


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """torch._grouped_mm's FLOPs (a formula torch's counter lacks): each output element is a dot
    product over a's last dimension, within its group. For (M, K) × (E, K, N) -> (M, N) each row
    is its expert's; for (K, M) × (M, N) -> (E, K, N), a weight gradient, the groups split the
    M rows between them, so the E outputs together contract M once."""
    n = 1
    for d in out_val:
        n *= d
    if len(a) == 2 and len(b) == 2:
        n //= out_val[0]
    return 2 * a[-1] * n


def _causal_aware(formula, index: int):
    def flops(*args, **kwargs):
        full = formula(*args, **kwargs)
        if len(args) > index and args[index] is True:
            s = args[0][-2] if index == 4 else args[1][-2]  # the query's sequence length
            return full * (s + 1) // (2 * s)
        return full
    return flops


# ops whose output on contiguous floating meta tensors of one dtype (and Python numbers) is a
# new contiguous tensor of that dtype: pointwise ones of the inputs' broadcast shape, roll of
# its input's, reductions over a list of dimensions of the reduced shape
_ATEN = torch.ops.aten
_POINTWISE = {_ATEN.add.Tensor, _ATEN.sub.Tensor, _ATEN.mul.Tensor, _ATEN.div.Tensor, _ATEN.neg.default,
              _ATEN.rsqrt.default, _ATEN.silu.default, _ATEN.sigmoid.default, _ATEN.exp.default,
              _ATEN.pow.Tensor_Scalar, _ATEN.silu_backward.default, _ATEN.sigmoid_backward.default,
              _ATEN.roll.default}
_REDUCTIONS = {_ATEN.mean.dim, _ATEN.sum.dim_IntList}
_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _on_meta(func, args, kwargs):
    """`func`'s output made directly, without its meta kernel (for these ops torch's Python
    reference: a hundred µs a call, half of a plan's time), where the result is known: an op
    of `_POINTWISE` or `_REDUCTIONS` on contiguous meta tensors of one floating dtype, each
    of one dimension or more; else None (the kernel runs). tests/test_clock.py holds every
    such output equal to the kernel's in shape, strides and dtype."""
    reduction = func in _REDUCTIONS
    if not (reduction or func in _POINTWISE) or any(k != "alpha" for k in kwargs):
        return None
    tensors = args[:1] if reduction or func is _ATEN.roll.default else args
    shapes, dtype = [], None
    for x in tensors:
        if isinstance(x, torch.Tensor):
            if not x.is_meta or x.dim() == 0 or not x.is_contiguous() or (dtype is not None and x.dtype != dtype):
                return None
            dtype = x.dtype
            shapes.append(x.shape)
        elif not isinstance(x, (int, float)) or isinstance(x, bool):
            return None
    if dtype not in _FLOATS:
        return None
    if not reduction:
        same = all(sh == shapes[0] for sh in shapes)  # (the common case, without broadcasting's reference)
        return torch.empty(shapes[0] if same else torch.broadcast_shapes(*shapes), dtype=dtype, device="meta")
    dims, keepdim = args[1], (args[2] if len(args) > 2 else False)
    if not dims or len(args) > 3:
        return None
    shape = shapes[0]
    reduced = {d % len(shape) for d in dims}
    out = [1 if i in reduced else n for i, n in enumerate(shape) if keepdim or i not in reduced]
    return torch.empty(out, dtype=dtype, device="meta")


class ComputeModel(TorchDispatchMode):
    def __init__(self, hw: Hardware, clock: RankClock):
        super().__init__()
        self.hw = hw
        self.flop_rate = hw.peak_bf16_flops * hw.matmul_fraction  # 16-bit matmuls
        self.fp32_rate = hw.fp32_flops * hw.matmul_fraction
        self.attention_rate = hw.peak_bf16_flops * hw.attention_fraction
        self.byte_rate = hw.hbm_bandwidth * hw.hbm_fraction
        # (the optimizer's one-kernel passes: Hardware.optimizer_hbm_fraction)
        self.optimizer_byte_rate = hw.hbm_bandwidth * (hw.optimizer_hbm_fraction or hw.hbm_fraction)
        self.floor = hw.kernel_floor
        self.kernels = 0
        self.by_op = None  # {op name: [kernels, seconds, bytes]} when set to a dict (calibration)
        # {"F", "B", "I", "W": seconds of a whole stage} when pipeline actions are charged fixed
        # costs instead of their ops (the bubble measurement: playground/bubble.py)
        self.unit_costs = None
        self.clock = clock
        self.flops = 0
        self.bytes = 0
        self._formula: dict = {}  # op -> its FLOP formula, None (bytes only) or False (free)
        self._fused = None  # [seconds, attention?] while inside a fused region
        self.slowdown = 1.0  # this rank's kernels take this many times as long (an injected slow rank)
        self.attention_speed = 1.0  # the flash kernels' speed relative to the profile's (`attention_kernels`)
        self._inlined = False  # inside `inlined`
        self.extra_floor = 0.0  # host seconds each op costs beside the floor (`selective_checkpoint`)

    def _classify(self, func):
        packet = func._overloadpacket
        if func.is_view or packet in _FREE:
            return False
        if packet in _COPIES:
            return _TRANSFER
        if packet is getattr(torch.ops.aten, "_grouped_mm", None):
            return _grouped_mm_flops
        formula = flop_registry.get(_ALIASES.get(packet, packet))
        if formula is not None and packet in _CAUSAL_ARG:
            formula = _causal_aware(formula, _CAUSAL_ARG[packet])
        return formula

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ATEN._local_scalar_dense.default and args[0].is_meta:
            # a value read on the host in a plan (an fp16 overflow flag): the host waits for the
            # device as the run's does; a meta tensor holds no value, and it reads as zero
            if self._fused is None:
                self.synchronize()
            return False if args[0].dtype is torch.bool else 0.0 if args[0].dtype.is_floating_point else 0
        out = _on_meta(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        formula = self._formula.get(func)
        if formula is None and func not in self._formula:
            formula = self._formula[func] = self._classify(func)
        if formula is _TRANSFER:
            if len({x.device for x in (*args, out) if isinstance(x, torch.Tensor)}) > 1:
                return out
            formula = None
        if formula is False:
            if func._overloadpacket is torch.ops.aten._local_scalar_dense and self._fused is None:
                self.synchronize()  # (inside a fused region it is the CPU implementation's, not the GPU's)
            self._host_only()
            return out
        nbytes = _nbytes(args) + _nbytes(kwargs.values()) + _nbytes(out if isinstance(out, (list, tuple)) else (out,))
        seconds = 0.0
        if formula is not None:
            flops = formula(*_shapes(args), **{k: _shapes(x) for k, x in kwargs.items()}, out_val=_shapes(out))
            self.flops += flops
            attention = self._fused is not None and self._fused[1] is True
            seconds = (flops / (self.attention_rate * self.attention_speed) if attention
                       else self._seconds(func, args, out, flops))
        if self._fused is not None:  # one kernel (or a compiled graph's): charged when the region ends
            if not self._inlined and (nbytes or seconds):
                self._fused[2] += 1  # (an op the graph launches: `region_op_floor`)
            if self._fused[1] == _BACK_TO_BACK and not self._inlined:
                self._fused[0] += max(seconds, nbytes / self.byte_rate)
                self.bytes += nbytes
            else:
                self._fused[0] += seconds
            return out
        if nbytes == 0 and seconds == 0:  # no tensor, or empty ones: nothing launches
            self._host_only()
            return out
        self._kernel(func._overloadpacket.__name__, seconds, nbytes)
        return out

    def _host_only(self) -> None:
        """An op that launches nothing (a view, an allocation): under a selective checkpoint's
        dispatch mode it still costs the host the mode's Python (`selective_checkpoint`)."""
        if self.extra_floor and self._fused is None:
            self.clock.launch(self.extra_floor * self.slowdown, 0.0, None)

    def _kernel(self, name: str, seconds: float, nbytes: int, host: float | None = None,
                byte_rate: float | None = None) -> None:
        """One kernel of max(its FLOP time, its bytes' time at `byte_rate`, else the model's),
        issued by the host one floor (or `host` seconds) after the previous (the clock's two
        queues); counted, and kept by name in `by_op`."""
        cost = max(seconds, nbytes / (byte_rate or self.byte_rate)) * self.slowdown
        self.bytes += nbytes
        self.kernels += 1
        self.clock.launch(((self.floor if host is None else host) + self.extra_floor) * self.slowdown, cost, name)
        if self.by_op is not None:
            row = self.by_op.setdefault(name, [0, 0.0, 0])
            row[0], row[1], row[2] = row[0] + 1, row[1] + cost, row[2] + nbytes

    def synchronize(self) -> None:
        """The host waits for the device (a value read on the host)."""
        self.clock.synchronize()

    def _seconds(self, func, args, out, flops: int) -> float:
        """The op's FLOP time: fused attention at the profile's fraction for its head dimension
        and sequence (the query's last two dimensions); 16-bit matmuls at the matmul fraction,
        in whole tiles and waves (Hardware.wave_quantization); other ops at the FP32 rate."""
        packet = func._overloadpacket
        if packet in _ATTENTION:  # (b, heads, s, head_dim) through SDPA's ops, (b, s, heads, head_dim) below them
            q = args[0]
            seq = q.shape[-2] if packet.__name__.startswith("_scaled_dot_product") else q.shape[1]
            rate = self.hw.peak_bf16_flops * self.hw.attention_fraction_at(q.shape[-1], seq) * self.attention_speed
            return flops / rate
        if _first_dtype(args) not in _HALF:
            return flops / self.fp32_rate
        if packet in _MATMULS and isinstance(out, torch.Tensor) and out.dim() >= 2:
            batch = out.numel() // (out.shape[-2] * out.shape[-1]) if out.numel() else 1
            return flops * self.hw.wave_quantization(out.shape[-2], out.shape[-1], batch) / self.flop_rate
        return flops / self.flop_rate

    @contextlib.contextmanager
    def fused(self, io_bytes: int, name: str = "fused", attention: bool = False, graph: bool = False,
              optimizer: bool = False):
        """The ops inside run as one fused kernel (FlashAttention's tiles stay on chip): their
        FLOPs are counted as usual, their intermediate tensors move no HBM bytes; the
        region is one kernel of max(Σ FLOPs / rate, io_bytes / bandwidth), io_bytes being what
        the kernel reads and writes in HBM. `name`: the kernel's row in `by_op`; `attention`:
        the region is a FlashAttention call (ring attention's blocks), whose FLOPs run at the
        attention rate whatever dtype the matmuls written out inside it use (float32 here).
        `graph`: the region is a compiled graph's forward (model/compiled.py, `region`), whose
        call costs the host the profile's `region_op_floor` per op it launches where the
        profile has one. `optimizer`: the region is an optimizer's pass over a flat unit, whose
        bytes move at the profile's `optimizer_hbm_fraction` of the bandwidth."""
        with self._one_launch(name, attention, io_bytes, graph, optimizer):
            yield self

    @contextlib.contextmanager
    def _one_launch(self, name: str, kind, io_bytes: int, graph: bool = False, optimizer: bool = False):
        """The ops inside charged as one launch of `name` when the region ends (`_fused` holds
        the seconds so far, `kind`: a fused kernel's attention flag, or `_BACK_TO_BACK`, and
        the ops that launch); the host's cost one kernel floor, or for a compiled graph's call
        (`graph`) `region_op_floor` an op where the profile measured it."""
        # (the mode may sit below others: activation checkpointing pushes its own)
        if self._fused is not None or self not in _get_current_dispatch_mode_stack():
            yield self  # nested (part of the outer region), or not counting (a replayed step)
            return
        self._fused = [0.0, kind, 0]
        try:
            yield self
        finally:
            (seconds, _, ops), self._fused = self._fused, None
            per_op = self.hw.region_op_floor if graph else None
            self._kernel(name, seconds, io_bytes, None if per_op is None else per_op * ops,
                         self.optimizer_byte_rate if optimizer else None)

    @contextlib.contextmanager
    def inlined(self):
        """Inside a compiled graph's region (`compiled`), the ops inside run within the kernels
        that consume their outputs (what Inductor fuses there: a compiled backward's
        recomputation of what its forward did not save): their FLOPs count, their bytes none."""
        with scoped(self, "_inlined", True):
            yield self

    @contextlib.contextmanager
    def selective_checkpoint(self):
        """The ops inside run through torch's selective-checkpoint dispatch mode (a
        checkpointed block's forward or recomputation under a selective policy): each costs
        the host the profile's `selective_floor` beside its floor, views and ops that launch
        nothing too, which the mode sees alike (none where unmeasured)."""
        with scoped(self, "extra_floor", self.hw.selective_floor or 0.0):
            yield self

    @contextlib.contextmanager
    def attention_kernels(self, generation: str):
        """The flash attention ops inside priced as `generation`'s kernels (`FLASH_GENERATIONS`:
        the model's `attention`, around a step's forward and backward)."""
        with scoped(self, "attention_speed", FLASH_GENERATIONS.get(generation, 1.0)):
            yield self

    @contextlib.contextmanager
    def pipeline_action(self, kind: str, chunks: int = 1):
        """One pipeline action charged its fixed cost (`unit_costs[kind]` / chunks) instead of
        its ops (model.regions.pipeline_action; the bubble measurement sets `unit_costs`)."""
        with self.paused():
            yield self
        self.clock.advance(self.unit_costs[kind] / chunks, kind)

    @contextlib.contextmanager
    def compiled(self, name: str = "compiled"):
        """The ops inside as the kernels of one torch.compile'd graph (a compiled region's
        backward, model/compiled.py): on the device each as it would run alone, max(FLOP time,
        bytes time), back to back; on the host one call, not one floor per op (the graph
        launches its kernels from one Python call), at `region_op_floor` an op where the
        profile measured it."""
        with self._one_launch(name, _BACK_TO_BACK, 0, graph=True):
            yield self

    def optimizer_step(self, optimizer):
        """Around `optimizer.step()`: the step as torch's fused AdamW runs it on a GPU, one
        kernel reading parameter, gradient and both moments and writing parameter and
        moments (7 tensors' bytes), instead of the ops of the implementation that runs here."""
        n = sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
        return self.fused(7 * n, "_fused_adamw", optimizer=True)

    @contextlib.contextmanager
    def step(self, mode=None):
        """One step of the rank's program, counted op by op (None), recorded ("record") or
        replayed from the recording ("replay", with op counting off)."""
        self.clock.begin_step(mode)
        if mode == "replay":
            if _get_current_dispatch_mode() is not self:
                raise RuntimeError("a replayed step needs the compute model on top of the dispatch-mode stack")
            with _pop_mode_temporarily():
                yield self
        else:
            yield self
        self.clock.end_step()

    @contextlib.contextmanager
    def paused(self):
        """Run a block with op counting off (its time is then the caller's to charge, as
        the pipeline benchmark does with fixed stage costs). Modes above it (the memory
        tracker's, for backward's temporaries) are off for the block too."""
        if self not in _get_current_dispatch_mode_stack():
            raise RuntimeError("pausing needs the compute model on the dispatch-mode stack")
        with contextlib.ExitStack() as popped:
            while True:
                top = _get_current_dispatch_mode()
                popped.enter_context(_pop_mode_temporarily())
                if top is self:
                    break
            yield self
