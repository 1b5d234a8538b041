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



@pytest.mark.parametrize("step", [1, 7])
def test_a_step_found_non_finite_changes_nothing_and_a_finite_one_is_the_plain_step(step):
    """`found_inf` 1.0 (a NaN or an Inf in the step, decided on the device): the masters, the
    moments, the copies and the step count as they were, also at the first step, whose bias
    corrections divide by zero; 0.0: bit for bit the step without it."""
    p, opt, g = _state(1031, step)
    s = opt.state[p]
    g = g.clone()
    g[5] = float("nan")
    copy = torch.full(p.shape, 7.0, dtype=torch.bfloat16)
    before = [t.detach().clone() for t in (p, s["exp_avg"], s["exp_avg_sq"], s["step"], copy)]
    master_adamw(opt, [g], [copy], found_inf=torch.tensor(1.0))
    for got, was in zip((p, s["exp_avg"], s["exp_avg_sq"], s["step"]), before):
        assert torch.equal(got.detach(), was)
    assert torch.equal(copy, p.detach().to(torch.bfloat16))  # (the copy is the master's, as after any step)
    p2, opt2, g2 = _state(1031, step)
    p3, opt3, _ = _state(1031, step)
    copies = [torch.empty(p2.shape, dtype=torch.bfloat16) for _ in range(2)]
    master_adamw(opt2, [g2], [copies[0]])
    master_adamw(opt3, [g2], [copies[1]], found_inf=torch.tensor(0.0))
    assert torch.equal(p2, p3) and torch.equal(copies[0], copies[1])
    assert all(torch.equal(opt2.state[p2][k], opt3.state[p3][k]) for k in ("step", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("fused", [False, True])
def test_torchs_adamw_skips_a_step_found_non_finite(fused):
    """`step_unless`: torch's fused kernel (on the CPU here, as on a GPU) skips on the device and
    keeps the step count; the default implementation reads the flag on the host; a finite step
    is the plain step."""
    from zero.optimizer import step_unless

    def make():
        p = torch.nn.Parameter(torch.randn(9, generator=torch.Generator().manual_seed(3)))
        opt = torch.optim.AdamW([p], lr=0.1, fused=fused or None)
        p.grad = torch.ones(9)
        opt.step()  # (a state to keep)
        p.grad = torch.full((9,), 2.0)
        return p, opt
    p, opt = make()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    assert step_unless(opt, torch.tensor(1.0)) is fused  # (False: the host read the skip)
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())
    assert not hasattr(opt, "found_inf")
    q, opt_q = make()
    assert step_unless(opt_q, torch.tensor(0.0))
    r, opt_r = make()
    opt_r.step()
    assert torch.equal(q, r) and float(opt_q.state[q]["step"]) == 2.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled pass and torch's fused kernel of a GPU")
def test_on_a_gpu_a_step_found_non_finite_is_skipped_without_the_host_reading_it():
    """The one pass compiled on the GPU and torch's fused CUDA AdamW given `found_inf` on the
    device: nothing moves at 1.0, the plain step at 0.0."""
    from zero.optimizer import step_unless
    for found, moves in ((1.0, False), (0.0, True)):
        p, opt, g = _state(4099, 3)
        p = torch.nn.Parameter(p.detach().cuda())
        opt = torch.optim.AdamW([p], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True)
        p.grad = g.float().cuda()
        opt.step()
        before = p.detach().clone()
        copy = torch.empty(p.shape, dtype=torch.bfloat16, device="cuda")
        master_adamw(opt, [g.cuda()], [copy], found_inf=torch.tensor(found, device="cuda"))
        assert torch.equal(p.detach(), before) is not moves and float(opt.state[p]["step"]) == 1 + moves
        before = p.detach().clone()
        p.grad = g.float().cuda()
        assert step_unless(opt, torch.tensor(found, device="cuda"))
        assert torch.equal(p.detach(), before) is not moves and float(opt.state[p]["step"]) == 1 + 2 * moves


@pytest.mark.parametrize("fraction", [None, 0.8])
def test_a_plan_streams_the_optimizers_passes_at_the_profiles_optimizer_rate(fraction):
    """On the meta device a pass over a unit is one kernel of its bytes (28 a parameter for
    master_adamw, 7 tensors' for torch's fused AdamW) at `optimizer_hbm_fraction` of the
    bandwidth, at `hbm_fraction` where the profile has none."""
    import dataclasses
    from model.regions import optimizer_kernel
    from simulator.clock import RankClock
    from simulator.compute_model import ComputeModel
    from simulator.hardware import load_hardware
    hw = dataclasses.replace(load_hardware("h100-sxm"), optimizer_hbm_fraction=fraction)
    rate = hw.hbm_bandwidth * (fraction or hw.hbm_fraction)
    n = 1 << 24
    master = torch.zeros(n, device="meta", requires_grad=True)
    opt = torch.optim.AdamW([master], lr=LR)
    grad, copy = (torch.empty(n, device="meta", dtype=torch.bfloat16) for _ in range(2))

    def priced(step) -> dict:
        model = ComputeModel(hw, RankClock())
        model.by_op = {}
        with model:
            step()
        return model.by_op
    assert priced(lambda: master_adamw(opt, [grad], [copy]))["master_adamw"][1] == pytest.approx(28 * n / rate, rel=1e-9)
    master.grad = grad.float()

    def torch_step():  # (inside the region a step runs torch's fused AdamW in)
        with optimizer_kernel(opt):
            torch._fused_adamw_([master], [master.grad], [grad.float()], [grad.float()], [], [torch.zeros(())],
                                lr=LR, beta1=B1, beta2=B2, weight_decay=WD, eps=EPS, amsgrad=False, maximize=False)
    assert priced(torch_step)["_fused_adamw"][1] == pytest.approx(7 * 4 * n / rate, rel=1e-9)
