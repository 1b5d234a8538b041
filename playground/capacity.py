"""Will a simulated world fit in this machine's memory? Estimated before any rank starts,
so that `--world 100000` is refused at once with the estimate and the largest world that
fits, instead of minutes of creating threads and then the OOM killer.

Every simulated rank holds its model states (parameters, gradients, AdamW's two moments:
16 bytes per parameter in float32, 32 in float64, of its tensor- and pipeline-parallel
share; ZeRO shards all but the parameters over dp) plus per-rank bookkeeping (the
modules, hooks, the ledger). Measured on this project's 2-core machine with DDP: 1.4 MB
per rank for the tiny preset (Ψ = 31k) and 22.3 MB for small (Ψ = 870k), against
0.5 MB and 13.9 MB of states: so per rank 1.6 × states + 1 MiB, above a fixed 0.5 GiB
(the interpreter, torch, the reference batch).
"""
from __future__ import annotations

import os

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
    layout, cfg = run.layout, run.model
    share = cfg.n_params() / (layout.tp * layout.pp)
    width = 8 if run.dtype == "float64" else 4
    states = share * width * (1 + (3 / layout.dp if layout.zero else 3))
    return STATE_FACTOR * states + PER_RANK


def simulated_memory(run) -> float:
    """Estimated bytes of a simulated run of `run` in this process."""
    return BASE + run.layout.world * per_rank_bytes(run)


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
    dp_max = int((budget - BASE) // (per_rank_bytes(run) * others)) if budget > BASE else 0
    fits = (f"the largest that fits is world {dp_max * others} (dp={dp_max} × {others})" if dp_max >= 1
            else "not even one data-parallel replica fits")
    raise ValueError(f"world={layout.world} on simulated ranks needs about {need / 2**30:.1f} GiB "
                     f"({per_rank_bytes(run) / 2**20:.1f} MiB per rank) but {available / 2**30:.1f} GiB is available; "
                     f"{fits}")
