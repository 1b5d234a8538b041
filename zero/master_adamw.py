"""AdamW (Loshchilov & Hutter 2019) on fp32 master weights from low-precision gradients, in
one pass per flat unit: the mixed-precision recipe of Micikevicius et al. 2018 ("Mixed
Precision Training": fp32 masters updated from the compute dtype's gradients, the compute
copies rounded from them), with the passes of that recipe fused into one.

Done as separate kernels, a step with compute copies reads and writes every parameter's
bytes three times: the gradient cast to fp32 (2 bytes read, 4 written), torch's fused AdamW
(28 bytes: master, gradient and both moments read, master and moments written), the master
rounded into its copy (4 read, 2 written): 40 bytes a parameter. `master_adamw` reads the
compute-dtype gradient as it is and writes the copy in the same pass: 28 bytes (on an H200,
6.4 ms a step for 1b-moe's 0.96B parameters against 12.5 ms: benchmarks/results/gpu/
run45_moe_parts and run46_master_adamw).

Its arithmetic is AdamW's as torch writes it (decoupled weight decay; ε added to the
bias-corrected root), in float32 as torch's fused kernel computes it, the constants and the
step's bias corrections in double, each rounded once to float: within float32 rounding of
the float64 formula (tests/test_master_adamw.py). It is not bit for bit torch's fused kernel
(which rounds its hyperparameters differently); the state is torch's AdamW's (`step`,
`exp_avg`, `exp_avg_sq`), so checkpoints and `load_state` see no difference. The check
(`playground check`) does not hold it: in float64 there are no compute copies, and in bf16
the check judges the loss and the gradients, not the weights; the formula test does.

On a GPU the pass is compiled (one kernel a unit); on the CPU it runs op by op; a plan (the
meta device) prices it as one kernel moving its bytes (`model.compiled.region`).
"""
from __future__ import annotations

import torch

from model.compiled import region

from .optimizer import step_count


def _update(p, g, m, v, copy, step_size, bias_correction2_sqrt, lr: float, beta1: float, beta2: float,
            weight_decay: float, eps: float):
    """One AdamW step of master `p` (fp32) from gradient `g` (any float dtype) and moments m
    and v (fp32), the step's `step_size` (lr over the first bias correction) and the root of
    the second bias correction as 0-d float32 tensors; writes p, m, v and the compute copy
    `copy`, in place."""
    g = g.to(torch.float32)
    p.sub_(lr * weight_decay * p)  # decoupled weight decay (the factor rounded once)
    m.copy_(beta1 * m + (1 - beta1) * g)  # (1 - β: computed in double, rounded once)
    v.copy_(beta2 * v + (1 - beta2) * g * g)
    p.sub_(step_size * m / (v.sqrt() / bias_correction2_sqrt + eps))
    copy.copy_(p)


def _update_unless(p, g, m, v, copy, step_size, bias_correction2_sqrt, found_inf, lr: float, beta1: float,
                   beta2: float, weight_decay: float, eps: float):
    """`_update`, the same arithmetic, unless `found_inf` (0-d float32, 1.0: a gradient was not
    finite): then p, m, v and the copy keep their values (each written as it was: the same
    bytes moved, no branch on the host)."""
    skip = found_inf > 0
    g = g.to(torch.float32)
    decayed = p - lr * weight_decay * p
    m_new = beta1 * m + (1 - beta1) * g
    v_new = beta2 * v + (1 - beta2) * g * g
    p_new = decayed - step_size * m_new / (v_new.sqrt() / bias_correction2_sqrt + eps)
    m.copy_(torch.where(skip, m, m_new))
    v.copy_(torch.where(skip, v, v_new))
    p.copy_(torch.where(skip, p, p_new))
    copy.copy_(p)


def _bias_corrections(step, beta1: float, beta2: float, lr: float) -> tuple:
    """(lr / (1 - β1^t), sqrt(1 - β2^t)) as 0-d float32 tensors on `step`'s device, from the
    step count t (a 0-d tensor, read on the device), in double."""
    t = step.to(torch.float64)
    return ((lr / (1 - beta1 ** t)).to(torch.float32),
            (1 - beta2 ** t).sqrt().to(torch.float32))


def adamw_formula(p, m, v, g, step: int, lr: float, betas: tuple, weight_decay: float, eps: float) -> tuple:
    """(p, m, v) after one AdamW step (Loshchilov & Hutter 2019, algorithm 2; ε added to the
    bias-corrected root, as torch writes it) in float64: what `master_adamw` is held to."""
    (beta1, beta2), (p, m, v, g) = betas, (t.detach().double() for t in (p, m, v, g))
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    return p - lr / (1 - beta1 ** step) * m / (v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps), m, v


@torch.no_grad()
def master_adamw(optimizer: torch.optim.AdamW, grads: list, copies: list, found_inf=None) -> None:
    """One AdamW step of `optimizer`'s parameters (fp32 masters, one param group) from
    `grads` (one per parameter, its shape, in the compute dtype), writing each master's
    rounded values into `copies` (one per parameter). The state is created as torch's AdamW
    creates it at the first step. `found_inf` (0-d float32 on the masters' device, 1.0: skip)
    leaves every value and the step count as they were, decided on the device (as torch's
    fused kernel does under a GradScaler)."""
    group, = optimizer.param_groups
    params, (beta1, beta2) = group["params"], group["betas"]
    lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
    if group.get("amsgrad") or group.get("maximize"):
        raise ValueError("master_adamw does AdamW alone: amsgrad and maximize are not supported")
    states = []
    for p in params:
        state = optimizer.state[p]
        if not state:
            state["step"] = step_count(optimizer, p, 0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states.append(state)
    torch._foreach_add_([s["step"] for s in states], 1)
    if not states:
        return
    if found_inf is not None:  # (the count back where the step is skipped)
        torch._foreach_sub_([s["step"] for s in states], [found_inf.to(states[0]["step"].device)] * len(states))
    # every unit steps together (one count), so one pair of corrections serves them all (a
    # plan's counts are on the CPU, its masters on meta: moved once)
    step_size, root = (c.to(params[0].device) for c in _bias_corrections(states[0]["step"], beta1, beta2, lr))
    for p, g, copy, s in zip(params, grads, copies, states):
        # what it moves: master and moments read and written, the gradient read, the copy written
        io = 6 * p.nbytes + g.nbytes + copy.nbytes
        if found_inf is None:
            region("master_adamw", io, _update, p, g, s["exp_avg"], s["exp_avg_sq"], copy, step_size, root, lr, beta1,
                   beta2, weight_decay, eps, optimizer=True)
        else:
            region("master_adamw", io, _update_unless, p, g, s["exp_avg"], s["exp_avg_sq"], copy, step_size, root,
                   found_inf, lr, beta1, beta2, weight_decay, eps, optimizer=True)
