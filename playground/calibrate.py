"""`playground calibrate`: measure this machine and fit a hardware profile to it
(docs/architecture.md, Contract 3; the compute and communication models it fits are
simulator/compute_model.py and simulator/cost_model.py).

    torchrun --nproc_per_node 2 -m playground calibrate --backend torch --base h200-datasheet --out h200.json

Every rank measures its own device (CUDA events on GPUs, the host clock on CPUs; medians
of repeats); rank 0 writes the profile. The peaks, the HBM bandwidth and the network come
from the `--base` profile (datasheet numbers); what is fitted:

- `matmul_fraction`: the bf16 GEMMs of one block and of the head of `--model` at
  `--micro-batch-size` (each weight's forward product and backward's two), achieved
  FLOP/s over the bf16 peak, each GEMM as often as a step runs it (a block's once per
  layer, the head's once: the time the model spends in them) and, where the base profile
  gives `sm_count` and `matmul_tiles`, its FLOPs counted in the whole tiles and waves a plan
  prices it in (`fit_matmuls`): at the model's own shapes the plan's GEMMs then take the
  time they were measured at. (Weighted once per shape, 1b's head, 0.82 of the peak on an
  H200 against 0.62-0.80 for the block's, put the fraction at 0.78 for the 0.74 of a step,
  and the tiles counted on top of a fraction that held them already.)
- `fp32_flops`: the same GEMMs in float32, weighted so, so that `fp32_flops ·
  matmul_fraction` is the achieved rate (torch's default float32 matmuls, TF32 off).
- `attention_fraction`, `attention_table`: causal `scaled_dot_product_attention` forward
  and backward, FLOPs counted as the compute model counts them (the causal half), at the
  model's shape (the fraction) and, on CUDA, at head dimensions 64, 128 and the model's
  over sequences of 512-16384 tokens at the model's tokens and width (the table a plan
  reads by head dimension and sequence, `attention_shapes`): a kernel's efficiency moves
  with the sequence, and a profile fitted at one shape alone planned every model's
  attention at that shape's rate. On CUDA each point is its kernels' time under torch's
  profiler: the host's launches are the floors' to price, not the kernel's.
- `hbm_fraction`: one block and the head of the model, forward and backward, under
  torch's profiler: the bytes its copies and elementwise ops (normalisation, RoPE,
  SwiGLU, the loss) move, as the compute model counts them on meta tensors, over their
  profiled device time, over the base bandwidth. Without a device profiler (CPUs): the
  median over elementwise kernels timed alone (copy, add, mul, SiLU, a cast, a scale),
  which are measured everywhere and kept in the record.
- `optimizer_hbm_fraction`: one pass of zero/master_adamw.py's step over a flat unit of 64 Mi
  parameters (1 Mi on CPUs), its 28 bytes a parameter over its time, over the base
  bandwidth: the rate a plan gives the optimizer's passes (on one H100 the step's pass ran
  at 0.78 of the bandwidth where the model's elementwise kernels ran at 0.65, and a plan at
  the latter put 1b-moe's optimizer at 12.4 ms a step against 10.3 measured:
  benchmarks/results/gpu/run71_h100_moe_recompute_profiles, run78_region_floor_h100).
- `kernel_floor`: what the host spends per op of the model's own training step: the
  whole step (all its blocks, the optimizer, the NaN check, compiled regions) trained at
  head dimension 8, a 512-token vocabulary and 16-token sequences (`narrow`: the same ops
  in the same order, each kernel a few µs, so the host's issuing is the step), its host
  time per step (the wall time less the waits for the device; the median over the steps of
  three fresh runs, as a host's speed moves between runs) less its collective calls
  at `collective_floor` and, on CUDA, less the host's time inside its compiled regions'
  calls, over the other ops a plan of the same program charges; at least the time per op
  of a bare chain of tiny adds. (A tiny forward and backward of one block,
  the measure before it, is kept in the record: its fixed costs, the backward's start
  among them, fall on some hundred ops where a step has thousands, and it read 59.7 µs an
  op on a host where 350m's step then ran at under 30 µs.)
- `region_op_floor`: what the host spends per op of a compiled region's graphs (the MoE
  layer's, the optimizer's `master_adamw`: model/compiled.py), in the same narrow step: on
  CUDA the host's time inside their forward calls and their backward nodes
  (model/region_timer.py), over the ops of their forward and backward graphs a plan charges.
  Priced apart because a compiled call's host cost is Inductor's wrapper launching the
  graph's kernels, not an eager op's dispatch: on one H100 host 1b-moe's regions took 2.1 ms
  a layer of its step, and a single floor over the whole step put that time on its eager
  ops, fitting 45.7 µs where 350m's step fitted 31.0 (benchmarks/results/gpu/run76, run77).
  Where the regions run op by op (CPUs), one kernel_floor.
- `selective_floor`: what selective activation checkpointing adds to the host's time per op
  of a checkpointed block (torch's selective checkpoint runs each op of the forward and of
  the recomputation through a Python dispatch mode): that tiny block checkpointed under the
  selective policy recomputing every matmul, less the same under full recomputation (the
  same kernels), over the ops the mode sees, views included.
- `collective_floor`: the host's time per collective call through the process group
  (issued and waited back to back, tiny all_reduces, whose device time is shorter); with
  one rank none is measured and a call costs one `kernel_floor`.
- `nvlink_latency` (α) and `nvlink_bandwidth` (1/β): all_reduce, all_gather,
  reduce_scatter, all_to_all and send/recv over message sizes from 1 KiB to `--max-mib`
  (nccl-tests sizes), each time against the cost model's formula for that op at this
  group size, α and β fitted by least squares in relative error (Hockney 1994). On one
  node the network cannot be measured: its α and β stay the base's, and `source` says so.
- `hbm_capacity`: the device's memory.

The profile file holds every `Hardware` field and a `calibration` record: each measured
point with what the fitted profile predicts for it, and the relative error.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from collectives import launch
from model import GPTConfig
from simulator.clock import RankClock
from simulator.compute_model import ComputeModel
from simulator.cost_model import collective_cost
from simulator.hardware import Hardware, load_hardware
from model.region_timer import RegionTimer, timing_regions

from .layout import Layout
from .run_config import RunConfig

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


# -- timing ------------------------------------------------------------------------------------
def timed(fn, device: str, repeats: int = 5, inner: int = 1) -> float:
    """Median seconds of one call of `fn` (each sample: `inner` calls back to back, averaged)."""
    fn()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


class MeasurementError(RuntimeError):
    """A measurement that cannot be fitted (`playground calibrate` prints it on one line)."""


def profiled_by_op(fn, calls: int = 3) -> dict:
    """{aten op: device seconds a call} of `fn` on CUDA under torch's profiler (CUPTI's
    kernel times, each kernel on the innermost aten op that launched it): the device's own
    time, without the host's gaps between launches. After one call outside the profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:  # (aten ops are CPU events)
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    by_op: dict = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0) if us is None else us
        if us and e.key.startswith("aten::"):
            name = e.key.removeprefix("aten::")
            by_op[name] = by_op.get(name, 0.0) + us / 1e6 / calls
    return by_op


# -- compute -------------------------------------------------------------------------------------
def gemm_shapes(cfg: GPTConfig, tokens: int) -> list:
    """[(m, k, n, per_step)] of the products a step of the model runs on `tokens` rows, each
    distinct shape once: for each linear layer's weight (out, in) on its rows, the forward
    x·Wᵀ (rows, in, out), the input gradient dY·W (rows, out, in) and the weight gradient
    dYᵀ·X (out, rows, in), as model/gpt.py runs them (q, k, v and o, gate, up and down each
    its own GEMM, not fused); `per_step`, how many times a step runs the shape. A MoE layer
    (model/moe.py): the router on every row, each routed expert's on its even share of the
    top-k choices (the grouped GEMM timed as one expert's), the shared experts' on every row."""
    d, L, moe = cfg.d_model, cfg.n_layers, cfg.n_moe_layers
    weights = [(tokens, d, d, 2 * L), (tokens, cfg.kv_dim, d, 2 * L)]  # (rows, out, in, per_step): q, o; k, v
    if L > moe:
        weights += [(tokens, cfg.d_ff, d, 2 * (L - moe)), (tokens, d, cfg.d_ff, L - moe)]  # gate, up; down
    if moe:
        g, E = cfg.expert_width, cfg.n_experts
        share = -(-tokens * cfg.top_k // E)
        weights += [(tokens, E, d, moe), (share, g, d, 2 * E * moe), (share, d, g, E * moe)]
        if cfg.n_shared_experts:
            s = cfg.n_shared_experts * g
            weights += [(tokens, s, d, 2 * moe), (tokens, d, s, moe)]
    weights.append((tokens, cfg.vocab_size, d, 1))  # the head
    shapes: dict = {}
    for rows, o, i, per_step in weights:
        for shape in ((rows, i, o), (rows, o, i), (o, rows, i)):
            shapes[shape] = shapes.get(shape, 0) + per_step
    return [(*shape, per_step) for shape, per_step in shapes.items()]


def measure_matmuls(cfg, tokens, device, dtype) -> list:
    rows = []
    for m, k, n, per_step in gemm_shapes(cfg, tokens):
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        t = timed(lambda: a @ b, device, inner=5)  # (back to back: the device's time, not the launch's)
        rows.append({"m": m, "k": k, "n": n, "dtype": str(dtype).removeprefix("torch."), "flops": 2 * m * k * n,
                     "per_step": per_step, "seconds": t})
        del a, b
    return rows


def fit_matmuls(bf16: list, fp32: list, base: Hardware) -> tuple:
    """(matmul_fraction, fp32_flops) from the timed GEMMs of `measure_matmuls`: each as often
    as a step runs it, the bf16 ones' FLOPs in whole tiles and waves of the base profile
    (Hardware.wave_quantization, NVIDIA's "Matrix Multiplication Background User's Guide"; 1
    without its fields), as the compute model prices them, so that a plan at the measured
    shapes gives the measured time, no quantization counted twice."""
    def work(r, tiles: bool):
        return r["per_step"] * r["flops"] * (base.wave_quantization(r["m"], r["n"]) if tiles else 1.0)
    fraction = sum(work(r, True) for r in bf16) / sum(r["per_step"] * r["seconds"] for r in bf16) \
        / base.peak_bf16_flops
    fp32_rate = sum(work(r, False) for r in fp32) / sum(r["per_step"] * r["seconds"] for r in fp32)
    return fraction, fp32_rate / fraction


def matmuls_predicted(rows: list, hw: Hardware) -> list:
    """The timed GEMMs, each with the time the compute model gives it on `hw` (`predicted`:
    a 16-bit one in whole tiles and waves, at least one kernel_floor) and its `error`."""
    out = []
    for r in rows:
        if r["dtype"] in ("bfloat16", "float16"):
            predicted = r["flops"] * hw.wave_quantization(r["m"], r["n"]) / (hw.peak_bf16_flops * hw.matmul_fraction)
        else:
            predicted = r["flops"] / (hw.fp32_flops * hw.matmul_fraction)
        predicted = max(hw.kernel_floor, predicted)
        out.append({**r, "predicted": predicted, "error": predicted / r["seconds"] - 1})
    return out


def counted(program, hw: Hardware | None = None, by_op: bool = False) -> ComputeModel:
    """The ComputeModel after running `program` (on meta tensors) under it: its FLOPs,
    kernels and, on `hw`, its time (the profile matters only for time)."""
    model = ComputeModel(hw or load_hardware("h100-sxm"), RankClock())
    model.by_op = {} if by_op else None
    with model:
        program()
    return model


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """FLOPs of causal attention forward and backward as the compute model counts them:
    the flash kernel a plan prices."""
    q = torch.empty(batch, heads, seq, head_dim, device="meta", dtype=torch.bfloat16, requires_grad=True)

    def program():
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)[0]
        out.backward(torch.empty_like(out))
    return counted(program).flops


ATTENTION_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_HEAD_DIMS = (64, 128)


def attention_shapes(cfg, batch: int, cuda: bool) -> list:
    """[(batch, heads, seq, head_dim)] calibrate times attention at: the model's own and, on
    CUDA, head dimensions 64, 128 and the model's at sequences 512-16384 and the model's,
    each at the model's tokens (micro-batch × sequence) and width (heads × head dimension),
    as a training step at that sequence would hold them. (An attention kernel's efficiency
    moves with both: on one H100 at head dimension 64, 0.11 of the peak at 512 tokens, 0.25 at
    2,048, 0.44 at 16,384: benchmarks/results/gpu/run79_device_fit_h100.) On CPUs the model's
    alone."""
    own = (batch, cfg.n_heads, cfg.seq_len, cfg.head_dim)
    if not cuda:
        return [own]
    tokens, width = batch * cfg.seq_len, cfg.n_heads * cfg.head_dim
    shapes = {own}
    for head_dim in sorted({*ATTENTION_HEAD_DIMS, cfg.head_dim}):
        for seq in sorted({*ATTENTION_SEQS, cfg.seq_len}):
            shapes.add((max(1, tokens // seq), max(1, width // head_dim), seq, head_dim))
    return sorted(shapes, key=lambda s: (s[3], s[2]))


def measure_attention(cfg, batch, device) -> list:
    """Causal SDPA forward and backward (separate query, key and value, as the model's) at
    each of `attention_shapes`: [{batch, heads, seq, head_dim, flops, seconds}]. The gradients
    are returned, not accumulated: a `.backward()` called again adds each new gradient into
    the last (three elementwise adds, nine tensors' bytes) inside the timed attention, where
    the model's attention writes its gradients once (on one H100 the one block's attention
    was priced 20-30% above its profiled kernels by a table timed so:
    benchmarks/results/gpu/run79_device_fit_h100). On CUDA `seconds` is the kernels' time
    under the profiler (`profiled_by_op`), `wall_s` the CUDA events' beside it: the events
    time the host's launches too where they outlast the kernels (on a slow H100 host 350m's
    attention read 0.130 of the peak by events, 0.26 ms planned to 0.47:
    benchmarks/results/gpu/run82_calibrate_slow_host_h100), and a plan prices the host apart."""
    rows = []
    for b, heads, seq, head_dim in attention_shapes(cfg, batch, device.startswith("cuda")):
        q, k, v = (torch.randn(b, heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)

        def step():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)
        row = {"batch": b, "heads": heads, "seq": seq, "head_dim": head_dim,
               "flops": attention_flops(b, heads, seq, head_dim), "seconds": timed(step, device, inner=3)}
        if device.startswith("cuda"):
            row["wall_s"], row["seconds"] = row["seconds"], sum(profiled_by_op(step).values())
        rows.append(row)
        del q, k, v, grad
    return rows


def fit_attention(rows: list, cfg, peak: float) -> tuple:
    """(attention_fraction at the model's own shape, attention_table or None): each measured
    point's FLOP/s over the bf16 peak, by head dimension and sequence (Hardware.attention_table,
    interpolated in log(sequence) between the points); no table from a single point."""
    for r in rows:  # (a rate from no time would be infinite: said, not replaced by the events' time)
        if r["seconds"] <= 0:
            raise MeasurementError(
                f"attention at batch {r['batch']}, heads {r['heads']}, sequence {r['seq']}, head dimension "
                f"{r['head_dim']}: no kernel time was recorded"
                + (f" (CUDA events timed {r['wall_s'] * 1e3:.3f} ms)" if "wall_s" in r else ""))
    fraction = {(r["head_dim"], r["seq"]): r["flops"] / r["seconds"] / peak for r in rows}
    own = fraction[(cfg.head_dim, cfg.seq_len)]
    if len(fraction) == 1:
        return own, None
    table = {}
    for (head_dim, seq), f in sorted(fraction.items()):
        table.setdefault(head_dim, []).append((seq, f))
    return own, {d: tuple(points) for d, points in table.items()}


def measure_elementwise(cfg, tokens, device) -> list:
    """Kernels whose time is their bytes: (name, bytes read and written, seconds)."""
    x = torch.randn(tokens, cfg.d_model, device=device, dtype=torch.bfloat16)
    y, w = torch.randn_like(x), torch.randn(cfg.d_model, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    n = x.numel() * x.element_size()
    kernels = {
        "copy": (lambda: out.copy_(x), 2 * n),
        "add": (lambda: torch.add(x, y, out=out), 3 * n),
        "mul": (lambda: torch.mul(x, y, out=out), 3 * n),
        "silu": (lambda: F.silu(x), 2 * n),
        "rsqrt-scale": (lambda: torch.mul(x, w, out=out), 2 * n),
        "to-float32": (lambda: x.float(), 3 * n),
    }
    rows = []
    for name, (fn, nbytes) in kernels.items():
        rows.append({"kernel": name, "bytes": nbytes, "seconds": timed(fn, device, inner=5)})
    return rows


def measure_optimizer(device: str) -> dict:
    """One pass of zero/master_adamw.py's step over a flat unit of fp32 masters from bf16
    gradients, writing bf16 compute copies (compiled on CUDA: one kernel; op by op on CPUs):
    {elements, bytes (28 a parameter: masters and moments read and written, the gradient
    read, the copy written), seconds}. The unit is 64 Mi elements on CUDA (a 1b block's
    flat unit is of that order), 1 Mi on CPUs."""
    from zero.master_adamw import master_adamw
    from zero.optimizer import adamw
    n = 1 << (26 if device.startswith("cuda") else 20)
    master = torch.zeros(n, device=device, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(n, device=device, dtype=torch.bfloat16)
    copy = torch.empty(n, device=device, dtype=torch.bfloat16)
    opt = adamw([master], lr=1e-4)
    seconds = timed(lambda: master_adamw(opt, [grad], [copy]), device, inner=3)
    return {"elements": n, "bytes": 28 * n, "seconds": seconds}


def measure_floor(device, ops: int = 200) -> float:
    """Seconds per op of `ops` tiny elementwise ops issued back to back."""
    x = torch.ones(8, device=device)

    def chain():
        y = x
        for _ in range(ops):
            y = y + 1
        return y
    return timed(chain, device) / ops


MEMORY_BOUND = ("copy", "elementwise")  # the classes of `op_class` whose time is their bytes


def op_class(name: str) -> str:
    """The class of an aten op (profiler's "aten::mm" or the dispatcher's "mm"): matmul,
    attention, copy (casts and copies: torch's profiler puts their kernels on copy_) or
    elementwise (everything else: elementwise, normalisation, reductions, indexing)."""
    name = name.removeprefix("aten::")
    if "attention" in name:
        return "attention"
    if name in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm"):
        return "matmul"
    if name in ("copy_", "_to_copy", "clone", "to", "contiguous"):
        return "copy"
    return "elementwise"


def one_layer_step(cfg: GPTConfig, micro_batch: int, device: str, layers: int = 1, ac: str = "none",
                   recompute_every: int | None = None):
    """A function running forward and backward of a one-block GPT of `cfg`'s shapes in bf16
    (the compute copies a mixed-precision run computes with) on `device`; `layers` blocks
    where asked (benchmarks/host_floor_gpu.py times the host's cost across depths), each
    checkpointed in `ac` mode, a selective policy recomputing every `recompute_every`-th
    matmul where given (activation_checkpointing/policy.py)."""
    from activation_checkpointing import checkpoint_blocks
    from model import GPT
    one = cfg.with_(n_layers=layers)
    model = GPT(one, dtype=torch.bfloat16, device=device)
    checkpoint_blocks(model, ac)
    if recompute_every:
        for block in model.blocks.values():
            block.recompute.every = recompute_every
    shape = (micro_batch, one.seq_len + 1)
    tokens = (torch.empty(shape, dtype=torch.long, device="meta") if device == "meta"
              else torch.randint(0, one.vocab_size, shape, device=device))

    def step():
        model(tokens[:, :-1], tokens[:, 1:]).backward()
    return step


def predicted_by_op(cfg, micro_batch, hw: Hardware) -> tuple:
    """({op or compiled region's name: [kernels, seconds, bytes]}, total seconds) the compute
    model gives one forward and backward of `one_layer_step` on `hw` (run on meta tensors)."""
    model = counted(one_layer_step(cfg, micro_batch, "meta"), hw, by_op=True)
    return model.by_op, model.clock.compute


def by_class(by_op: dict) -> dict:
    """{class: [kernels, seconds, bytes]} of a {name: [kernels, seconds, bytes]} (`op_class`)."""
    out: dict = {}
    for name, (k, t, b) in by_op.items():
        row = out.setdefault(op_class(name), [0, 0.0, 0])
        row[0], row[1], row[2] = row[0] + k, row[1] + t, row[2] + b
    return out


def memory_bound(moved: dict, profiled: dict) -> dict:
    """What the HBM rate is fitted on: the one block's memory-bound kernels, the copy and
    elementwise classes (`op_class`) on both sides, {"bytes", "seconds", "regions"}: the bytes
    a plan moves in them (`moved`: {name: [kernels, seconds, bytes]}) and the device time
    torch's profiler gave their aten ops (`profiled`: {aten op: device seconds}). Summed by
    class, not matched by name: the profiler gives a kernel to whichever op launched it
    (a cast's to copy_, the loss gradient's zeroing to fill_, not to nll_loss_backward).
    A compiled region is left out on both sides: the plan prices it under the region's name,
    which no aten op has (its `regions`), partly at the matmul rate, and on the GPU its
    generated kernels carry no aten name; the grouped GEMMs it calls are GEMMs (`op_class`).
    (A fit that took them in read a MoE layer's grouped GEMMs as memory traffic: 1b-moe's
    hbm_fraction 0.63 against 350m's 0.73, benchmarks/results/gpu/run79_device_fit_h100.)"""
    regions = sorted(n for n in moved if not hasattr(torch.ops.aten, n))
    nbytes = sum(b for n, (_, _, b) in moved.items() if op_class(n) in MEMORY_BOUND and n not in regions)
    seconds = sum(t for n, t in profiled.items() if op_class(n) in MEMORY_BOUND)
    return {"bytes": nbytes, "seconds": seconds, "regions": regions}


def measure_selective_floor(cfg: GPTConfig, device: str, rounds: int = 5) -> float:
    """Seconds selective activation checkpointing adds to the host per op of a checkpointed
    block: the tiny forward and backward of one block (`measure_model_kernels`: batch 1,
    sequence 16: the host's issuing is the step), checkpointed under the selective policy
    recomputing every matmul (so the same kernels as full recomputation, less the attention
    kernel's), less the same under full recomputation, over the ops its dispatch mode sees
    there (the forward's and the recomputation's, views included: counted on meta tensors by
    the compute model, with no floor but one second per such op); the median over `rounds`
    alternated pairs (one pair alone read 14 to 67 µs on three H100 hosts: a host's speed
    drifts within seconds, and a difference of two medians taken apart holds that drift);
    at least 0."""
    tiny = cfg.with_(seq_len=16)
    selective = one_layer_step(tiny, 1, device, ac="selective", recompute_every=1)
    full = one_layer_step(tiny, 1, device, ac="full")
    differences = [timed(selective, device, repeats=7) - timed(full, device, repeats=7) for _ in range(rounds)]
    counting = dataclasses.replace(load_hardware("h100-sxm"), kernel_floor=0.0, selective_floor=1.0)
    seen = counted(one_layer_step(tiny, 1, "meta", ac="selective", recompute_every=1), counting).clock.issuing
    return max(0.0, statistics.median(differences) / seen)


# -- the host's cost per op in the model's own training step ---------------------------------------
PROGRAM_STEPS = 10  # steps of the narrow program; the first PROGRAM_WARMUP are not timed
PROGRAM_WARMUP = 4  # (compiled regions compile, AdamW makes its moments, the allocator fills its cache)
# Rounds of the narrow program, each a fresh run: on one H100 host the narrow step's eager
# floor read 30.6-48.9 µs an op over three rounds of each of three models, its steps steady
# within a round and jumping between rounds (and once within one), with no order by model
# (benchmarks/results/gpu/run80_narrow_floor_h100); one run, as before, fitted whichever
# moment it met.
PROGRAM_ROUNDS = 3


def narrow(cfg: GPTConfig) -> GPTConfig:
    """`cfg`'s program at a width where every kernel is short: the same depth, heads, key/value
    heads, experts and routing, so the same ops in the same order, at head dimension 8, a
    512-token vocabulary and 16-token sequences (on a GPU each kernel then takes a few µs, and
    the host's issuing is the step)."""
    d = 8 * cfg.n_heads
    expert = max(16, -(-cfg.expert_d_ff * d // cfg.d_model // 16) * 16) if cfg.expert_d_ff else 0
    return cfg.with_(d_model=d, d_ff=0, expert_d_ff=expert, vocab_size=512, seq_len=16)


def program_run(cfg: GPTConfig, ranks: int, backend: str) -> RunConfig:
    """The training run whose step the program floor times: `narrow(cfg)` data parallel over
    the calibrated ranks, micro-batch 1, bf16 compute copies of fp32 masters (the recipe a plan
    prices)."""
    return RunConfig(model=narrow(cfg), layout=Layout(dp=ranks, micro_batch_size=1), steps=PROGRAM_STEPS,
                     dtype="bfloat16", backend=backend, progress=False)


def measure_program(world, cfg: GPTConfig, backend: str, device: str = "cpu", rounds: int = PROGRAM_ROUNDS) -> dict:
    """The host's own time per step of the model's training program (`program_run`: the whole
    step, the optimizer, the NaN check and compiled regions included), trained `rounds` times:
    each step's wall time less the time the host waited for the device (`host_blocked`, as
    benchmarks/fidelity.py measures a run's), the median over every round's steps after its
    warm-up. On CUDA the host's time inside the compiled regions' calls too, forward and
    backward (model/region_timer.py), the median of each step's (`region_host_s`), and of each
    step's time outside them (`eager_host_s`)."""
    from .training import train_rank
    timer = RegionTimer() if device.startswith("cuda") else None
    own, regions, by_round = [], [], []
    with timing_regions(timer):
        for _ in range(rounds):
            out = train_rank(world, program_run(cfg, world.size, backend))
            steps = [t - b for t, b in zip(out["step_times"], out["host_blocked"])][PROGRAM_WARMUP:]
            own += steps
            by_round.append(statistics.median(steps))
            if timer is not None:
                regions += out["region_host"][PROGRAM_WARMUP:]
    got = {"host_s": statistics.median(own), "steps_s": own, "rounds": rounds, "round_host_s": by_round}
    if timer is not None:
        got.update(region_host_s=statistics.median(regions), region_steps_s=regions,
                   eager_host_s=statistics.median(o - r for o, r in zip(own, regions)),
                   regions=region_calls(timer, rounds * PROGRAM_STEPS))
    return got


def region_calls(timer: RegionTimer, steps: int) -> list:
    """Per region and way (forward, backward): its calls a step and the median host seconds of
    a call over the last half of its calls (past compilation), for the record."""
    by = {}
    for name, way, seconds in timer.calls:
        by.setdefault((name, way), []).append(seconds)
    return [{"region": name, "way": way, "calls_per_step": len(times) / steps,
             "median_s": statistics.median(times[len(times) // 2:])} for (name, way), times in sorted(by.items())]


def issued(run: RunConfig) -> tuple:
    """(ops, ops of compiled regions' graphs, collective calls) one step of `run` issues on its
    first rank, as a plan charges them: `run` planned on a profile whose floors are one second
    an op outside compiled regions (none an op inside one, none a call), then one second an op
    inside one, then one second a call."""
    from .planning import plan
    base = load_hardware("h100-sxm")
    counts = []
    for op, in_region, call in ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)):
        hw = dataclasses.replace(base, name="counting", kernel_floor=op, region_op_floor=in_region,
                                 collective_floor=call, selective_floor=0.0)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "counting.json")
            with open(path, "w") as f:
                json.dump(hw.to_dict(), f)
            counts.append(plan(dataclasses.replace(run, hardware=path, backend="sim")).values[0]["step"]["issuing"])
    return tuple(counts)


def program_floor(host_s: float, ops: float, calls: float, collective_floor: float | None) -> float:
    """The host's seconds per op that make a plan of the program issue its step in the time the
    host took (`host_s`): that less its collective calls at the measured collective floor, over
    its ops."""
    return max(0.0, host_s - calls * (collective_floor or 0.0)) / ops


def eager_part(program: dict) -> tuple:
    """(host seconds, ops) of the program that the kernel floor is fitted on: where the host's
    time in compiled regions was timed (CUDA), the step less it over the other ops; elsewhere
    the regions run op by op as the rest does, the whole step over all its ops."""
    if program.get("region_host_s") is None:
        return program["host_s"], program["ops"] + program["region_ops"]
    return program["host_s"] - program["region_host_s"], program["ops"]


def program_floors(program: dict, collective_floor: float | None, at_least: float = 0.0) -> tuple:
    """(kernel_floor, region_op_floor) from the program's host time and what a plan of it
    issues (`issued`): the kernel floor `program_floor` over `eager_part`, at least `at_least`;
    the regions' timed time over their graphs' ops, or where untimed the kernel floor (None
    where the program has no region)."""
    host, ops = eager_part(program)
    floor = max(at_least, program_floor(host, ops, program["calls"], collective_floor))
    if not program["region_ops"]:
        return floor, None
    timed = program.get("region_host_s")
    return floor, floor if timed is None else timed / program["region_ops"]


def measure_model_kernels(cfg, micro_batch, device) -> dict:
    """One forward and backward of a one-block GPT of the model's shapes: the wall time
    per step (device events around it, so host gaps count) and, on CUDA, the device time
    of each aten op (`profiled_by_op`); and the same step at a tiny size (batch 1,
    sequence 16), whose wall time over its kernel count is the host's cost per op."""
    step = one_layer_step(cfg, micro_batch, device)
    out = {"wall_s": timed(step, device, repeats=5)}
    if device.startswith("cuda"):
        out["device_by_op_s"] = profiled_by_op(step)
    tiny = cfg.with_(seq_len=16)
    small = one_layer_step(tiny, 1, device)
    kernels = counted(one_layer_step(tiny, 1, "meta")).kernels
    out["tiny_wall_s"], out["tiny_kernels"] = timed(small, device, repeats=5), kernels
    return out


# -- collectives ---------------------------------------------------------------------------------
def message_sizes(max_mib: float) -> list:
    """1 KiB to max_mib, ×4 apart (nccl-tests' -f 4)."""
    out, s = [], 1024
    while s <= max_mib * 2**20:
        out.append(s)
        s *= 4
    return out


def measure_collective(op: str, size: int, device: str) -> float:
    """Median seconds of one `op` with message size `size` bytes (nccl-tests' definition:
    the all_reduce/broadcast buffer, the all_gather output, the reduce_scatter input, the
    all_to_all buffer; send/recv: the message) on the default group."""
    p, rank = dist.get_world_size(), dist.get_rank()
    n = max(p, size // 4 // p * p)  # float32 elements, a multiple of p
    big = torch.ones(n, device=device)
    small = torch.ones(n // p, device=device)
    received = torch.empty_like(big)
    fns = {
        "all_reduce": lambda: dist.all_reduce(big),
        "all_gather": lambda: dist.all_gather_into_tensor(big, small),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(small, big),
        "all_to_all": lambda: dist.all_to_all_single(received, big),
        "send_recv": lambda: (dist.send(big, (rank + 1) % p) if rank % 2 == 0 else dist.recv(big, (rank - 1) % p))
        if rank < p - p % 2 else None,
    }
    inner = 20 if size <= 2**20 else 5 if size <= 2**26 else 2
    dist.barrier()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename in 2.13
        return timed(fns[op], device, repeats=5, inner=inner)


def measure_collective_floor(world, device: str) -> dict:
    """Seconds per call of a tiny all_reduce issued and waited back to back: through the
    playground's process group (its call and ledger entry, the backend's timing events and
    run-ahead bound, torch's call) and through torch.distributed alone. Either is the
    host's cost per call where that exceeds the device's (a tiny all_reduce is a few µs
    on the device), medians of 5 repeats."""
    x = torch.ones(8, device=device)
    calls = 400 if device.startswith("cuda") else 40  # (gloo on CPUs: about a millisecond a call)

    def playground():
        for _ in range(calls):
            world.all_reduce(x, label="calibrate.floor")

    def torch_alone():
        for _ in range(calls):
            dist.all_reduce(x)
    dist.barrier()
    return {"playground_s": timed(playground, device) / calls, "torch_s": timed(torch_alone, device) / calls}


def cost_op(op: str) -> str:
    """The cost model's name for a measured op (a send/recv pair is priced as its send)."""
    return "send" if op == "send_recv" else op


def coefficients(op: str, size: float, p: int, hw: Hardware) -> tuple:
    """(c_α, c_β) with cost = c_α·α + c_β·β for `op` at this size on p ranks of one node,
    under the algorithm the cost model chooses for `hw`."""
    name = cost_op(op)
    _, algorithm = collective_cost(name, size, range(p), hw)
    forced = algorithm if name == "all_reduce" else "auto"
    unit_alpha = dataclasses.replace(hw, nvlink_latency=1.0, nvlink_bandwidth=float("inf"))
    unit_beta = dataclasses.replace(hw, nvlink_latency=0.0, nvlink_bandwidth=1.0)
    return (collective_cost(name, size, range(p), unit_alpha, forced)[0],
            collective_cost(name, size, range(p), unit_beta, forced)[0])


def fit_alpha_beta(points: list, p: int, hw: Hardware) -> tuple:
    """(α, 1/β) minimising Σ ((c_α·α + c_β·β − t) / t)² over points [(op, size, t)]; a
    coefficient that comes out negative is set to zero and the other refitted."""
    rows = np.array([[*coefficients(op, s, p, hw)] for op, s, _ in points], dtype=float)
    t = np.array([t for _, _, t in points], dtype=float)
    a = rows / t[:, None]
    alpha, beta = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
    if alpha < 0:
        alpha, beta = 0.0, float(np.linalg.lstsq(a[:, 1:], np.ones_like(t), rcond=None)[0][0])
    if beta <= 0:
        beta, alpha = 0.0, float(np.linalg.lstsq(a[:, :1], np.ones_like(t), rcond=None)[0][0])
    return float(alpha), (1.0 / beta if beta > 0 else float("inf"))


# -- the program ---------------------------------------------------------------------------------
def measure(world, cfg: GPTConfig, micro_batch: int, max_mib: float, device: str, backend: str) -> dict:
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    tokens = micro_batch * cfg.seq_len
    out = {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
           "capacity": torch.cuda.get_device_properties(device).total_memory if device.startswith("cuda") else 0,
           "matmul_bf16": measure_matmuls(cfg, tokens, device, torch.bfloat16),
           "matmul_fp32": measure_matmuls(cfg, tokens, device, torch.float32),
           "attention": measure_attention(cfg, micro_batch, device),
           "elementwise": measure_elementwise(cfg, tokens, device), "optimizer": measure_optimizer(device),
           "floor": measure_floor(device), "selective_floor": measure_selective_floor(cfg, device),
           "one_layer": measure_model_kernels(cfg, micro_batch, device),
           "program": measure_program(world, cfg, backend, device), "collectives": []}
    if world.size > 1:
        out["collective_floor"] = measure_collective_floor(world, device)
        for op in COLLECTIVES:
            for size in message_sizes(max_mib):
                out["collectives"].append({"op": op, "size": size, "seconds": measure_collective(op, size, device)})
    return out


def fit(m: dict, base: Hardware, p: int, name: str, cfg: GPTConfig, micro_batch: int) -> tuple:
    """(the fitted Hardware, the calibration record) from one rank's measurements."""
    matmul_fraction, fp32 = fit_matmuls(m["matmul_bf16"], m["matmul_fp32"], base)
    attention_fraction, attention_table = fit_attention(m["attention"], cfg, base.peak_bf16_flops)
    one = m["one_layer"]
    moved, _ = predicted_by_op(cfg, micro_batch, base)
    hbm_fit = memory_bound(moved, one.get("device_by_op_s", {}))
    if hbm_fit["seconds"]:  # the model's own memory-bound kernels, as the profiler timed them
        hbm_fraction = hbm_fit["bytes"] / hbm_fit["seconds"] / base.hbm_bandwidth
    else:  # (no device profiler on CPUs) the elementwise kernels timed alone
        hbm_fraction = statistics.median(r["bytes"] / r["seconds"] for r in m["elementwise"]) / base.hbm_bandwidth
    optimizer_hbm_fraction = m["optimizer"]["bytes"] / m["optimizer"]["seconds"] / base.hbm_bandwidth
    collective_floor = m["collective_floor"]["playground_s"] if "collective_floor" in m else None
    ops, region_ops, calls = issued(program_run(cfg, p, "sim"))
    program = {**m["program"], "ops": ops, "region_ops": region_ops, "calls": calls}
    floor, region_op_floor = program_floors(program, collective_floor, at_least=m["floor"])
    alpha, bandwidth = base.nvlink_latency, base.nvlink_bandwidth
    points = [(c["op"], c["size"], c["seconds"]) for c in m["collectives"]]
    if points:
        alpha, bandwidth = fit_alpha_beta(points, p, base)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    hw = dataclasses.replace(
        base, name=name, matmul_fraction=matmul_fraction, fp32_flops=fp32, attention_fraction=attention_fraction,
        attention_table=attention_table, hbm_fraction=hbm_fraction, optimizer_hbm_fraction=optimizer_hbm_fraction,
        kernel_floor=floor, selective_floor=m["selective_floor"], region_op_floor=region_op_floor,
        hbm_capacity=float(m["capacity"] or base.hbm_capacity),
        collective_floor=collective_floor,
        nvlink_latency=alpha, nvlink_bandwidth=bandwidth,
        source=f"playground calibrate on {p}× {m['device']} ({when}); peaks, HBM bandwidth and network from "
               f"{base.name}{'' if points else '; NVLink not measured (one rank)'}")
    model = ComputeModel(hw, RankClock())
    record = {"base": base.name, "ranks": p, "device": m["device"], "model": cfg.to_dict(), "micro_batch": micro_batch, "chain_floor_s": m["floor"],
              "tiny_block_floor_s": one["tiny_wall_s"] / one["tiny_kernels"], "program": program,
              "collective_floor": m.get("collective_floor"), "matmuls": [], "attention": [], "elementwise": [],
              "optimizer": m["optimizer"],
              "collectives": []}
    predicted, total = predicted_by_op(cfg, micro_batch, hw)
    classes = by_class(predicted)
    record["one_layer"] = {**one, "predicted_s": total, "hbm_fit": hbm_fit if hbm_fit["seconds"] else None,
                           "predicted_by_class_s": {c: row[1] for c, row in classes.items()},
                           "kernels_by_class": {c: row[0] for c, row in classes.items()}}
    record["matmuls"] = matmuls_predicted(m["matmul_bf16"] + m["matmul_fp32"], hw)
    record["attention"] = [{**r, "fraction": r["flops"] / r["seconds"] / hw.peak_bf16_flops} for r in m["attention"]]
    for r in m["elementwise"]:
        predicted = max(hw.kernel_floor, r["bytes"] / model.byte_rate)
        record["elementwise"].append({**r, "predicted": predicted, "error": predicted / r["seconds"] - 1})
    for op, size, t in points:
        predicted = collective_cost(cost_op(op), size, range(p), hw)[0]
        record["collectives"].append({"op": op, "size": size, "seconds": t, "predicted": predicted,
                                      "error": predicted / t - 1})
    return hw, record


def calibrate(backend: str, world_size: int | None, cfg: GPTConfig, micro_batch: int, base: str, max_mib: float,
              name: str, device: str | None = None) -> tuple:
    """Measure on every rank of a torch.distributed job and fit rank 0's measurements:
    (Hardware, calibration record)."""
    res = launch(_measure_rank, world_size, backend, args=(cfg, micro_batch, max_mib, device, backend), timeout=600.0)
    return fit(res.values[0], load_hardware(base), res.world_size, name, cfg, micro_batch)


def _measure_rank(world, cfg, micro_batch, max_mib, device, backend):
    if device is None:
        device = f"cuda:{dist.get_rank() % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    return measure(world, cfg, micro_batch, max_mib, device, backend)


def write_profile(hw: Hardware, record: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump({**hw.to_dict(), "calibration": record}, f, indent=1)


def _one_layer_line(one: dict) -> str:
    measured: dict = {}  # the profiled device time by class
    for name, seconds in one.get("device_by_op_s", {}).items():
        measured[op_class(name)] = measured.get(op_class(name), 0.0) + seconds
    classes = ", ".join(f"{c} {one['predicted_by_class_s'].get(c, 0) * 1e3:.2f}"
                        + (f"/{measured.get(c, 0) * 1e3:.2f}" if measured else "") for c in
                        ("matmul", "attention", "copy", "elementwise"))
    return (f"  one block + head, forward and backward: measured {one['wall_s'] * 1e3:.2f} ms wall, predicted "
            f"{one['predicted_s'] * 1e3:.2f} ms; by class, ms predicted{'/profiled' if measured else ''}: {classes}")


def _hbm_fit(record: dict) -> str:
    """What of the one block the HBM rate was fitted on (`memory_bound`), if profiled."""
    fit = record["one_layer"].get("hbm_fit")
    if not fit:
        return ": the elementwise kernels timed alone"
    left = f", its compiled regions left out ({', '.join(fit['regions'])})" if fit["regions"] else ""
    return f": the one block's copies and elementwise kernels, {fit['bytes'] / 1e9:.2f} GB in {fit['seconds'] * 1e3:.2f} ms{left}"


def _calls(program: dict) -> str:
    return f" and {program['calls']:.0f} collective calls" if program["calls"] else ""


def _rounds(program: dict) -> str:
    """The whole step's host time in each run of the narrow program, where there were several."""
    times = program.get("round_host_s") or []
    return f"; the step's host by run {', '.join(f'{t * 1e3:.1f}' for t in times)} ms" if len(times) > 1 else ""


def _program_lines(hw: Hardware, record: dict) -> list:
    """kernel_floor's and region_op_floor's lines: what of the narrow step each is fitted on."""
    program, us = record["program"], 1e6
    timed = program.get("region_host_s") is not None
    host, ops = eager_part(program)
    lines = [f"  kernel_floor       {hw.kernel_floor * us:.1f} µs  (host per op of the model's training step at head "
             f"dimension 8: {host * 1e3:.2f} ms a step{' outside its compiled regions' if timed else ''} over {ops:.0f} "
             f"ops{_calls(program)}{_rounds(program)}; a tiny forward and backward of one block: "
             f"{record['tiny_block_floor_s'] * us:.1f} µs, a chain of adds: {record['chain_floor_s'] * us:.1f} µs)"]
    if hw.region_op_floor is None:
        return lines + ["  region_op_floor    none  (the step has no compiled region: a call costs one kernel_floor)"]
    return lines + [f"  region_op_floor    {hw.region_op_floor * us:.1f} µs  " + (
        f"(host per op of a compiled region's graph, in the same step: {program['region_host_s'] * 1e3:.2f} ms a step "
        f"in their calls, forward and backward, over {program['region_ops']:.0f} ops)" if timed else
        "(the regions run op by op on this device: one kernel_floor)")]


def _attention_timing(record: dict) -> str:
    """How the attention was timed: on CUDA its kernels under the profiler, the events'
    wall time at the model's shape beside it (`measure_attention`)."""
    own = [r for r in record["attention"] if "wall_s" in r and
           (r["head_dim"], r["seq"]) == (record["model"]["d_model"] // record["model"]["n_heads"], record["model"]["seq_len"])]
    if not own:
        return ""
    return f"; its kernels' time under the profiler, {own[0]['fraction'] * own[0]['seconds'] / own[0]['wall_s']:.3f} by CUDA events"


def _attention_table_lines(hw: Hardware) -> list:
    if not hw.attention_table:
        return []
    return [f"    head dimension {d:<4}" + "  ".join(f"{s}: {f:.3f}" for s, f in points)
            for d, points in sorted(hw.attention_table.items())]


def summary(hw: Hardware, record: dict) -> str:
    """The fitted constants and the error of the fit per kind of measurement."""
    def spread(rows):
        errs = [abs(r["error"]) for r in rows]
        return f"median |error| {statistics.median(errs):.0%}, worst {max(errs):.0%}" if errs else "not measured"
    lines = [f"profile {hw.name}: {hw.source}",
             f"  matmul_fraction    {hw.matmul_fraction:.3f}  ({hw.matmul_fraction * hw.peak_bf16_flops / 1e12:.0f} "
             f"TFLOP/s bf16; per GEMM {spread([r for r in record['matmuls'] if r['dtype'] == 'bfloat16'])})",
             f"  fp32_flops         {hw.fp32_flops / 1e12:.1f} TFLOP/s peak-equivalent "
             f"({hw.fp32_flops * hw.matmul_fraction / 1e12:.1f} achieved; per GEMM "
             f"{spread([r for r in record['matmuls'] if r['dtype'] == 'float32'])})",
             f"  attention_fraction {hw.attention_fraction:.3f}  "
             f"({hw.attention_fraction * hw.peak_bf16_flops / 1e12:.0f} TFLOP/s, causal fwd+bwd, at the model's head "
             f"dimension and sequence{_attention_timing(record)})",
             *_attention_table_lines(hw),
             f"  hbm_fraction       {hw.hbm_fraction:.3f}  ({hw.hbm_fraction * hw.hbm_bandwidth / 1e12:.2f} TB/s"
             + _hbm_fit(record) + f"; each kernel alone {spread(record['elementwise'])})",
             f"  optimizer_hbm_fraction {hw.optimizer_hbm_fraction:.3f}  "
             f"({hw.optimizer_hbm_fraction * hw.hbm_bandwidth / 1e12:.2f} TB/s: one master_adamw pass over "
             f"{record['optimizer']['elements'] / 2**20:.0f} Mi parameters, {record['optimizer']['seconds'] * 1e3:.2f} ms)",
             *_program_lines(hw, record),
             f"  selective_floor    {hw.selective_floor * 1e6:.1f} µs  (host per op a selective checkpoint's "
             f"dispatch mode adds, in the forward and the recomputation: that tiny block, selective less full)",
             _one_layer_line(record["one_layer"]),
             f"  collective_floor   {hw.call_floor * 1e6:.1f} µs  (host per collective call"
             + (f"; torch.distributed alone {record['collective_floor']['torch_s'] * 1e6:.1f} µs)"
                if record.get("collective_floor") else ": not measured, one kernel_floor)"),
             f"  nvlink α, 1/β      {hw.nvlink_latency * 1e6:.1f} µs, {hw.nvlink_bandwidth / 1e9:.0f} GB/s"
             + (f"  (per call {spread(record['collectives'])})" if record["collectives"] else "")]
    for op in COLLECTIVES:
        rows = [r for r in record["collectives"] if r["op"] == op]
        if rows:
            lines.append(f"    {op:<15}" + "  ".join(f"{r['size'] // 1024}K {r['seconds'] * 1e6:.0f}µs{r['error']:+.0%}"
                                                 if r['size'] < 2**20 else
                                                 f"{r['size'] // 2**20}M {r['seconds'] * 1e3:.2f}ms{r['error']:+.0%}"
                                                 for r in rows))
    return "\n".join(lines)
