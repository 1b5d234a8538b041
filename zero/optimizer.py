"""AdamW (Loshchilov & Hutter 2019) as every strategy builds it: torch's, with its fused
CUDA kernel (one pass over parameters, gradients and moments, instead of the several
multi-tensor passes of the default implementation) whenever every parameter is a CUDA
floating-point tensor; the default implementation elsewhere (CPU, meta)."""
from __future__ import annotations

import torch


def adamw(params, **kwargs) -> torch.optim.AdamW:
    params = list(params)
    fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **kwargs)


def step_count(optimizer: torch.optim.Optimizer, param: torch.Tensor, step: int) -> torch.Tensor:
    """AdamW's step count for `param`'s state, as the optimizer itself would hold it: on
    the parameter's device for the fused kernel, on the CPU otherwise (a resumed run)."""
    fused = optimizer.defaults.get("fused")
    return torch.tensor(float(step), dtype=torch.float32, device=param.device if fused else "cpu")


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """The updates AdamW has made (its state's step count; 0 before its first): fewer than the
    training steps where some were skipped (a non-finite gradient, an fp16 overflow), and
    what its bias correction (Kingma & Ba 2015, section 2) goes on from after a resume."""
    return int(max((float(st["step"]) for st in optimizer.state.values() if "step" in st), default=0.0))


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None) -> bool:
    """`optimizer.step()` unless `found_inf` (a 0-d float32 tensor: 1.0 where a gradient held a
    NaN or an Inf) says to skip it. torch's fused kernel skips on the device, leaving the step
    count as it was (as under a GradScaler, which hands it `found_inf` so), without the host
    reading the flag; the default implementation reads it. False where the host read a skip."""
    if found_inf is not None and not optimizer.defaults.get("fused"):
        if found_inf.item():
            return False
        found_inf = None
    if found_inf is None:
        optimizer.step()
        return True
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    return True
