"""Whether a planned peak fits a device: the memory a plan may use is the profile's HBM less
a headroom, the share that torch's caching allocator and the CUDA context take beyond the
tensors a plan counts.

The plan counts tensors, but an allocation needs a free block of its size among the
segments the caching allocator has reserved, so a peak close to the HBM can run out of
memory with bytes to spare (the README's "Activation checkpointing" gives the H200 runs
that showed it, with the default allocator and with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True). Hence a default headroom of 12% of HBM,
and `--memory-headroom 0.02` for runs with expandable segments. Within the HBM but above
the usable share, a layout is `tight`: it may run, and may not.
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
