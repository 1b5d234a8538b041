"""Whether a planned peak fits a device: the memory a plan may use is the profile's HBM less
a headroom, the share that torch's caching allocator and the CUDA context take beyond the
tensors a plan counts.

The plan counts tensors (within 0.1% of `torch.cuda.max_memory_allocated` on the committed
GPU runs), but an allocation needs a free block of its size among the segments the caching
allocator has reserved. On one H200 with the default allocator (benchmarks/results/gpu/
run27_one_gpu), the 1b preset ran at a planned 84.7% of HBM (118.5 GiB measured) and ran out
of memory at 88.4% (23.75 GiB reserved but unallocated when a 15.35 GiB fp32 logits tensor was
asked for) and at 91.1%. With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torch's
allocator maps pages into one growing segment; run30_expandable) those two ran, within 0.1% of
the plan, and only a peak of 99.5% did not (the CUDA context and NCCL held 1.3 GiB outside the
allocator). Hence the default headroom of 12% of HBM, and `--memory-headroom 0.02` for runs
with expandable segments. Under 12%, a layout is `tight`: it may run, and may not.
"""
from __future__ import annotations

DEFAULT_HEADROOM = 0.12  # (this module imports nothing at the top: the command's --help reads it without torch)


def usable(hw, headroom: float = DEFAULT_HEADROOM) -> float:
    """Bytes of `hw`'s HBM a plan's peak may take."""
    return hw.hbm_capacity * (1.0 - headroom)


def fits(peak: float, hw, headroom: float = DEFAULT_HEADROOM) -> bool:
    return peak <= usable(hw, headroom)


def verdict(peak: float, hw, headroom: float = DEFAULT_HEADROOM) -> str:
    """'fits', 'tight' (within HBM, not within its usable part) or 'OOM by ...'."""
    from collectives.ledger import human_bytes
    if peak > hw.hbm_capacity:
        return f"OOM by {human_bytes(peak - hw.hbm_capacity)}"
    return "fits" if fits(peak, hw, headroom) else f"tight (over {1 - headroom:.0%})"
