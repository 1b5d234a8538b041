"""AdamW in one pass over fp32 masters from bf16 gradients (zero/master_adamw.py): one step
from a random state against AdamW's formula in float64, its state torch's, the copies the
masters rounded; a sabotaged update fails; and the ZeRO step with compute copies uses it."""
import math

import pytest
import torch

from zero import master_adamw as one_pass
from zero.master_adamw import adamw_formula, master_adamw

LR, WD, B1, B2, EPS = 3e-4, 0.1, 0.9, 0.95, 1e-8


def _state(n: int, step: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, generator=gen) * 0.02).requires_grad_()
    opt = torch.optim.AdamW([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-6
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m, "exp_avg_sq": v}
    g = (torch.randn(n, generator=gen) * torch.logspace(-6, 0, n)).to(torch.bfloat16)
    return p, opt, g


def _formula(p, m, v, g, step: int):
    return adamw_formula(p, m, v, g, step, LR, (B1, B2), WD, EPS)


def _rel(a, b, before) -> float:
    """The worst error of `a` against the exact `b`, per element relative to the larger of the
    value before the step and the step's change (where they cancel, the change's rounding is
    what float arithmetic leaves)."""
    before = before.detach().double()
    scale = torch.maximum(before.abs(), (b - before).abs()).clamp(min=1e-30)
    return float(((a.detach().double() - b) / scale).abs().max())


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_one_step_is_adamw_within_float_rounding(step):
    p, opt, g = _state(4099, step)
    s = opt.state[p]
    before = [t.detach().clone() for t in (p, s["exp_avg"], s["exp_avg_sq"])]
    want = _formula(*before, g, step)
    copy = torch.empty(p.shape, dtype=torch.bfloat16)
    master_adamw(opt, [g], [copy])
    assert float(s["step"]) == step
    for got, exact, was in zip((p, s["exp_avg"], s["exp_avg_sq"]), want, before):
        assert got.dtype == torch.float32
        assert _rel(got, exact, was) < 1e-6  # float32 rounding of each operation (2^-24 each)
    assert torch.equal(copy, p.detach().to(torch.bfloat16))


def test_state_is_created_as_torch_creates_it():
    p = torch.zeros(5, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=LR)
    master_adamw(opt, [torch.ones(5, dtype=torch.bfloat16)], [torch.empty(5, dtype=torch.bfloat16)])
    ref = torch.zeros(5, requires_grad=True)
    ref_opt = torch.optim.AdamW([ref], lr=LR)
    ref.grad = torch.ones(5)
    ref_opt.step()
    assert set(opt.state[p]) == set(ref_opt.state[ref])
    assert opt.state[p]["step"].dtype == ref_opt.state[ref]["step"].dtype
    assert torch.allclose(p.detach(), ref.detach(), rtol=1e-6, atol=0)


def test_a_sabotaged_update_fails(monkeypatch):
    """Weight decay as an L2 term in the gradient (Adam's, not AdamW's) is caught."""
    real = one_pass._update

    def l2(p, g, m, v, copy, step_size, root, lr, beta1, beta2, weight_decay, eps):
        real(p, (g.double() + weight_decay * p.double()).float(), m, v, copy, step_size, root, lr, beta1, beta2, 0.0,
             eps)
    monkeypatch.setattr(one_pass, "_update", l2)
    p, opt, g = _state(4099, 7)
    s = opt.state[p]
    before = [t.detach().clone() for t in (p, s["exp_avg"], s["exp_avg_sq"])]
    want = _formula(*before, g, 7)
    master_adamw(opt, [g], [torch.empty(p.shape, dtype=torch.bfloat16)])
    assert max(_rel(got, exact, was) for got, exact, was in zip((p, s["exp_avg"], s["exp_avg_sq"]), want, before)) > 1e-3


def test_amsgrad_is_refused():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        master_adamw(torch.optim.AdamW([p], amsgrad=True), [torch.zeros(3)], [torch.zeros(3)])


@pytest.mark.parametrize("stage,fused,used", [(0, True, True), (1, True, True), (2, True, True), (3, True, False),
                                              (0, False, False), (2, False, False)])
def test_zero_steps_with_compute_copies_in_one_pass(monkeypatch, stage, fused, used):
    """Stages 0-2 with bf16 compute copies step through master_adamw (stage 3, which keeps
    no copy, through torch's AdamW; so every stage with `fused_master_step` off), and the
    run still trains."""
    from model import preset
    from playground import Layout, RunConfig
    from playground.training import train
    calls = []
    real = one_pass.master_adamw
    import zero.zero as engine
    monkeypatch.setattr(engine, "master_adamw", lambda *a: (calls.append(1), real(*a)))
    run = RunConfig(model=preset("tiny"), layout=Layout(dp=2, zero=stage, micro_batch_size=2), dtype="bfloat16",
                    bf16_copies=stage == 0, fused_master_step=fused, steps=2, progress=False)
    out = train(run)
    assert bool(calls) == used
    assert all(math.isfinite(x) for x in out.losses)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_check_passes_bf16_zero_through_the_one_pass(stage):
    """ZeRO-1/2 in bf16 (compute copies, so the one pass) against the one-device reference in
    float64 over 3 steps: the loss and every gradient within bf16's bounds (in bf16 the check
    reports the weights without judging them: the one pass's arithmetic is held to the
    formula above)."""
    from model import preset
    from playground import Layout, RunConfig
    from playground.equivalence import check
    run = RunConfig(model=preset("tiny", vocab_size=62, d_model=44, n_heads=2, d_ff=61, n_layers=2),
                    layout=Layout(dp=2, zero=stage, microbatches=2, micro_batch_size=2), steps=3, dtype="bfloat16",
                    progress=False)
    rep = check(run)
    assert rep.passed, [r for r in rep.rows if not r.ok]

