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
