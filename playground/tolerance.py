"""The equivalence check's tolerances, derived from the arithmetic (docs/architecture.md,
Contract 5).

The check takes every step of the reference from the layout's own state (its weights and
AdamW moments before the step, gathered), so each comparison is one step's rounding, and
errors never compound over steps.

Loss and gradients. A layout computes the same sums as one device in another order (a
reduction split over ranks, a matmul over a slice, a ring's blocks), so each result
differs from the reference by rounding: a sum of n terms differs from the exact sum by at
most about n·u of the sum of its magnitudes (Higham 2002, "Accuracy and Stability of
Numerical Algorithms", §4.2), u the dtype's unit roundoff, and typically by √n·u. The
tolerance is ULPS units of roundoff relative to the tensor's largest reference value.
bfloat16 and float16 runs are judged loosely (their weights and moments not at all):
prove a layout in float64. Where a backward amplifies rounding beyond that, the check raises
a gradient's tolerance to the reference's own sensitivity (playground/sensitivity.py).

Weights and moments: what AdamW (Loshchilov & Hutter 2019) can make of gradients that
pass. From the same state (w, m, v), if the layout's gradient differs from the reference's
g by at most δg = tol · max|g| (the gradient tolerance on that tensor), then with AdamW's
bias corrections at step t (a = (1 − β1)/(1 − β1^t), b = (1 − β2)/(1 − β2^t)) and the
reference's new moments m', v' (m̂ = m'/(1 − β1^t), s = √(v'/(1 − β2^t)) + eps), exactly:

    |δm'| ≤ (1 − β1)·δg                      |δv'| ≤ (1 − β2)·(2|g|·δg + δg²)
    |δs|  ≤ √b·δg       (the norm of (√(b·g²), √(rest of v̂)) moves by at most √b·δg)
    |δ(m̂/s)| ≤ a·δg / s_min + |m̂|·|δs| / (s·s_min),     s_min = max(s − |δs|, eps)
    |δw'| ≤ lr·|δ(m̂/s)|

The division by s ≥ eps is why a fixed share of the update cannot judge weights: an
element whose gradients are tiny (a rare token's embedding row) turns a last-bit
gradient difference into a weight difference of up to lr·δg/eps, while a sharding bug
moves the weights by a whole update. To each bound is added the layout's own rounding of
the step in its dtype: ROUNDING units of roundoff of the magnitude of what each result is
made of (β1·m and (1 − β1)·g may cancel in m'), the reference's plus the difference (and
of s inside |δs|).
Weight decay multiplies the same w on both sides and adds only rounding.
"""
from __future__ import annotations

import math

import torch

# units of roundoff a layout's loss and gradients may differ by, relative to the largest
# reference value of the tensor (benchmarks/check_sweep.py shows the margin of correct
# layouts at many shapes)
ULPS = 1024
# the layout's own rounding of one AdamW step, in units of roundoff of each result: the
# moments' update (2), the square root and the bias corrections (2), the division and the
# update (2); two sides that round differently differ by up to 2 ulps (4u) of each result
ROUNDING = 16

UNIT_ROUNDOFF = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}

# 16-bit computations against float64: loss and gradients judged at a fixed share (about 5
# and 13 units of bfloat16's roundoff); weights and moments reported only
LOW_PRECISION = {"bfloat16": {"loss": 2e-2, "grad": 5e-2}, "float16": {"loss": 5e-3, "grad": 1e-2}}


def tolerances(dtype: str) -> dict:
    """{"loss", "grad": the relative tolerance; "weight": True when weights and moments are
    judged (by `step_bounds`), None when they are only reported}."""
    if dtype in LOW_PRECISION:
        return {**LOW_PRECISION[dtype], "weight": None}
    rel = ULPS * UNIT_ROUNDOFF[dtype]
    return {"loss": rel, "grad": rel, "weight": True}


@torch.no_grad()
def step_bounds(grad, new_state: dict, step: int, group: dict, grad_tol: float, unit: float) -> dict:
    """Per element, how far the layout's weight and moments after one AdamW step (the
    `step`-th, from the same state as the reference) may be from the reference's, given
    its gradient within `grad_tol` of the reference's `grad` (relative to max |grad|);
    `new_state`: the reference's {"param", "exp_avg", "exp_avg_sq"} after the step; `group`:
    the optimizer's lr, betas and eps; `unit`: the layout's roundoff."""
    lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
    w, m, v = new_state["param"], new_state["exp_avg"], new_state["exp_avg_sq"]
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    dg = grad_tol * (grad.abs().max().item() if grad.numel() else 0.0)
    m_hat = m.abs() / bc1
    # m' = β1·m + (1 − β1)·g may cancel: it rounds at its terms' magnitude, |β1·m| ≤ |m'| + (1 − β1)|g|
    m_terms = m.abs() + 2 * (1 - b1) * grad.abs()
    s = (v / bc2).sqrt() + eps
    ds = math.sqrt((1 - b2) / bc2) * dg + ROUNDING * unit * s
    s_min = (s - ds).clamp(min=eps)
    du = ((1 - b1) / bc1 * dg + ROUNDING * unit * m_terms / bc1) / s_min + m_hat * ds / (s * s_min)
    dw, dm, dv = lr * du, (1 - b1) * dg, (1 - b2) * (2 * grad.abs() * dg + dg * dg)
    # each result rounded on the layout's side at the magnitude of what it is made of (the
    # reference's terms plus the difference; w' = w·(1 − lr·λ) − lr·m̂/s, so |w| ≤ |w'| + lr·|m̂/s|)
    return {"param": dw + ROUNDING * unit * (w.abs() + lr * m_hat / s + dw),
            "exp_avg": dm + ROUNDING * unit * (m_terms + dm),
            "exp_avg_sq": dv + ROUNDING * unit * (v + dv)}
