"""Will a simulated world fit in this machine's memory? Estimated before any rank starts,
so that `--world 100000` is refused at once with the estimate and the largest world that
fits, instead of minutes of creating threads and then the OOM killer.

Every simulated rank holds its model states (parameters, gradients, AdamW's two moments:
16 bytes per parameter in float32, 32 in float64, of its tensor- and pipeline-parallel
share; ZeRO shards the moments, from stage 2 the gradients and at stage 3 the parameters
over its shard group) plus per-rank bookkeeping (the
modules, hooks, the ledger). Measured on this project's 2-core machine with DDP: 1.4 MB
per rank for the tiny preset (Ψ = 31k) and 22.3 MB for small (Ψ = 870k), against
0.5 MB and 13.9 MB of states: so per rank 1.6 × states + 1 MiB, above a fixed 0.5 GiB
(the interpreter, torch, the reference batch). Each rank also holds its activations for
the microbatches in flight (`activation_bytes`: Korthikanti et al. 2022's per-layer count,
which grows with the sequence length), so `--seq-len 100000` is refused too when it cannot
fit.

How long a run will take is estimated the same way, before it starts: the model FLOPs of
every step (`GPTConfig.flops_per_token`, attention's s² included) over this machine's
matmul rate, measured once with NumPy in a few milliseconds. A run estimated at more than
ten minutes is announced in one line with its estimate (the command still runs it: the
progress bar and Ctrl-C remain).
"""
from __future__ import annotations

import math
import os
import time

from zero.rules import model_state_bytes

BASE = 2**29  # bytes: the process before any rank
PER_RANK = 2**20  # bytes of bookkeeping per rank
STATE_FACTOR = 1.6  # what a rank's model states cost in process memory, measured (above)


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def per_rank_bytes(run) -> float:
    """A rank's model states in process memory: its tp·pp share of the parameters, the
    gradients and AdamW's two moments in the parameters' width, ZeRO sharding them by stage
    over its shard group (dp_shard·cp; zero.model_state_bytes, as the search's bound)."""
    layout, cfg = run.layout, run.model
    states = model_state_bytes(cfg.n_params() / (layout.tp * layout.pp), layout.zero, layout.dp_shard * layout.cp,
                               width=8 if run.dtype == "float64" else 4)
    return STATE_FACTOR * states + PER_RANK


def activation_bytes(run) -> float:
    """A rank's activations while its microbatches in flight wait for their backward:
    Korthikanti et al. 2022 count s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit (the
    a·s² term is the attention scores, which the flash kernel does not keep), here scaled
    to the run's width; full activation checkpointing keeps one input per block; the last
    stage adds the logits (three copies of s·b·V in float32: logits, softmax, gradient)."""
    cfg, layout = run.model, run.layout
    width = 8 if run.dtype == "float64" else 4
    s, b, h = cfg.seq_len / layout.cp, layout.micro_batch_size, cfg.d_model
    if layout.ac == "full":
        per_layer = s * b * h * width
    else:
        per_layer = s * b * h * 34 * width / 2 / layout.tp
        if cfg.attention == "unfused":
            per_layer += 5 * cfg.n_heads * s * s * b * width / 2 / layout.tp
    in_flight = min(layout.microbatches, layout.pp) if layout.pp > 1 else 1
    return in_flight * per_layer * cfg.n_layers / layout.pp + 3 * s * b * cfg.vocab_size * 4 / layout.tp


def simulated_memory(run) -> float:
    """Estimated bytes of a simulated run of `run` in this process."""
    return BASE + run.layout.world * (per_rank_bytes(run) + activation_bytes(run))


def check_simulated_memory(run, available: int | None = None, fraction: float = 0.9) -> None:
    """Raise ValueError with the estimate and the largest dp that fits when the simulated
    world would need more than `fraction` of the available memory."""
    available = available_memory() if available is None else available
    if available is None:
        return
    need = simulated_memory(run)
    budget = fraction * available
    if need <= budget:
        return
    layout = run.layout
    others = layout.world // layout.dp
    per_rank = per_rank_bytes(run) + activation_bytes(run)
    dp_max = int((budget - BASE) // (per_rank * others)) if budget > BASE else 0
    fits = (f"the largest that fits is world {dp_max * others} (dp={dp_max} × {others})" if dp_max >= 1
            else "not even one data-parallel replica fits")
    raise ValueError(f"world={layout.world} on simulated ranks needs about {need / 2**30:.1f} GiB "
                     f"({per_rank / 2**20:.1f} MiB per rank, {activation_bytes(run) / 2**20:.1f} MiB of it activations) but "
                     f"{available / 2**30:.1f} GiB is available; "
                     f"{fits}")


def matmul_rate() -> float:
    """This machine's float32 matmul FLOP/s, the best of a few 512² products (NumPy's BLAS,
    as torch's on a CPU: within a small factor, which is what an estimate needs)."""
    import numpy as np
    a = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * 512**3 / max(best, 1e-9)


def estimated_seconds(run, steps: int, passes: float = 1.0, rate: float | None = None) -> float:
    """Seconds of model FLOPs for `steps` steps of `run` on this machine (`passes`: 2 for a
    check, whose reference recomputes each step); at least what the run will take, and
    an underestimate for small models, whose time goes to Python, not to FLOPs."""
    flops = run.model.flops_per_token() * run.tokens_per_step * steps * passes
    if run.layout.ac != "none":
        flops *= 4 / 3  # backward recomputes the forward
    if flops < 1e11:  # (a few seconds anywhere: not worth measuring the machine)
        return flops / 1e11
    return flops / (rate or matmul_rate())


def duration(seconds: float) -> str:
    """3 h 10 min, 12 min, 45 s."""
    if seconds >= 3600:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    return f"{int(seconds // 60)} min" if seconds >= 60 else f"{seconds:.0f} s"
