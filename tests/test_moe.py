"""Mixture of experts with expert parallelism: every layout against one device in float64
(with the capacity dropping tokens, and dropless), the dispatch at unit level, sabotaged
dispatches and divisors that must fail, the ledger's all-to-all bytes, and runs on the
simulated clock."""
import threading
from dataclasses import replace

import pytest
import torch

import model.moe as mm
from collectives import launch
from model import GPT, preset
from model.moe import MoE, choose, route
from moe import ExpertParallelDispatch
from playground import Layout, LayoutError, RunConfig, check, train

BASE = preset("tiny-moe", vocab_size=61)  # 2 blocks, both MoE, 4 experts, top-2, capacity factor 1


def _run(model=BASE, dtype="float64", steps=3, microbatches=2, **axes):
    return RunConfig(model=model, layout=Layout(microbatches=microbatches, micro_batch_size=2, **axes), steps=steps,
                     dtype=dtype, progress=False)


def _dropped(rep):
    return sum(int(r.name.split(": ")[1].split(" ")[0]) for r in rep.rows if r.what == "dropped")


CASES = {
    "ep1-E4-k2": dict(dp=2),
    "ep2-E4-k2": dict(dp=2, ep=2),
    "ep4-E4-k2": dict(dp=4, ep=4),
    "ep2-E8-k1": dict(dp=2, ep=2, model=BASE.with_(n_experts=8, top_k=1)),
    "ep4-E8-k2": dict(dp=4, ep=4, model=BASE.with_(n_experts=8)),
    "ep2-E4-k2-dropless": dict(dp=2, ep=2, model=BASE.with_(capacity_factor=0.0)),
    "ep4-E8-k1-dropless": dict(dp=4, ep=4, model=BASE.with_(n_experts=8, top_k=1, capacity_factor=0.0)),
    "dp4-ep2": dict(dp=4, ep=2),
    "pp2-ep2": dict(pp=2, dp=2, ep=2, microbatches=4),
    # split backward: the experts' weights get their gradients in I, and W syncs (their wrapper
    # must reduce them then; found by benchmarks/check_sweep.py)
    "pp2-ep2-zb1": dict(pp=2, dp=2, ep=2, microbatches=4, schedule="zb1"),
    "pp2-tp2-sp-zb1-zero1": dict(pp=2, tp=2, sequence_parallel=True, microbatches=2, schedule="zb1", zero=1),
    "ep2-zero1": dict(dp=2, ep=2, zero=1),
    "ep2-zero3": dict(dp=2, ep=2, zero=3),
    "cp2-ep2": dict(cp=2, ep=2),
    "dp2-cp2-ep4": dict(dp=2, cp=2, ep=4),
    "moe-every-2-pp2": dict(pp=2, dp=2, ep=2, microbatches=2, model=BASE.with_(n_layers=4, moe_every=2)),
    "ep2-tp2-sp": dict(dp=2, tp=2, sequence_parallel=True, ep=2),
    "ep1-tp2-sp": dict(tp=2, sequence_parallel=True),
    "ep2-tp2-sp-zero3": dict(dp=2, tp=2, sequence_parallel=True, ep=2, zero=3),
    "dp2-tp2-pp2-ep2-sp": dict(dp=2, tp=2, pp=2, sequence_parallel=True, ep=2, microbatches=4),
}


# (the default tier keeps one of each kind: these repeat a sibling's axes at another size)
SLOW_CASES = {"dp2-tp2-pp2-ep2-sp", "ep4-E4-k2", "ep4-E8-k1-dropless", "pp2-ep2-zb1", "dp2-cp2-ep4", "moe-every-2-pp2",
              "ep4-E8-k2", "dp4-ep2", "ep2-tp2-sp", "pp2-ep2", "ep2-zero1", "ep1-tp2-sp"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_moe_layout_matches_one_device(name):
    kw = dict(CASES[name])
    rep = check(_run(**kw))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
    assert rep.worst("loss").max_rel < 1e-14 and rep.worst("grad").max_rel < 1e-12
    model = kw.get("model", BASE)
    if model.capacity_factor:
        assert _dropped(rep) > 0  # the capacity is active, and drops the same tokens on both sides
    else:
        assert _dropped(rep) == 0


def test_moe_in_float32_and_bfloat16():
    """bf16's routing flips against float64 are near-ties at bf16's share, replayed: its
    gradients, dropped tokens and biases are judged as float64's are."""
    assert check(_run(dtype="float32", dp=2, ep=2)).passed
    rep = check(_run(dtype="bfloat16", dp=2, ep=2, model=BASE.with_(capacity_factor=0.0)))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
    assert rep.tolerance["grad"] is not None and rep.worst("grad").ratio is not None
    autocast = check(replace(_run(dtype="bfloat16", dp=2, ep=2, model=BASE.with_(capacity_factor=0.0)),
                             bf16_copies=False))
    assert autocast.passed, (autocast.problems, [r for r in autocast.rows if not r.ok])


@pytest.mark.parametrize("dtype,zero", [("bfloat16", 0), ("bfloat16", 1), pytest.param("bfloat16", 3, marks=pytest.mark.slow)])
def test_the_experts_engine_keeps_float32_masters(dtype, zero):
    """Under expert parallelism the experts have an engine of their own, made after the dense
    parameters' engine has turned those into compute copies: its masters must still be the
    experts' float32 weights (they were the bf16 compute copies, stepped in place with bf16
    moments: the check's initial weights caught it)."""
    run = _run(dtype=dtype, dp=2, ep=2, zero=zero, steps=2)
    rep = check(run)
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


def _experts_overflow_at_step_2(monkeypatch, step):
    """Wrap the optimizer's step (`step`: the real one or a sabotage) to plant an inf in the
    experts' engine's gradient on rank 0 at the second step of each run."""
    from playground.data_parallel import ShardedOptimizer
    calls = {}

    def planted(self, found_inf=None):
        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1
        if name == "sim-rank-0" and calls[name] % 3 == 2:
            experts = [e for e in self.engines if "experts" in e.label]
            experts[0].local_grads()[0][1].view(-1)[0] = float("inf")
        return step(self, found_inf)
    monkeypatch.setattr(ShardedOptimizer, "step", planted)


FP16_LAYOUTS = {"dp2-ep2": (BASE, dict(dp=2, ep=2)),
                "dp2-ep2-zero1-dropless": (BASE.with_(capacity_factor=0.0), dict(dp=2, ep=2, zero=1)),
                "dsmoe-pp2-dp2-ep2": (preset("tiny-dsmoe", vocab_size=61), dict(pp=2, dp=2, ep=2)),
                "dp2-tp2-sp-ep2": (BASE, dict(dp=2, tp=2, sequence_parallel=True, ep=2))}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "pp2" in n or "tp2" in n else n
                                  for n in FP16_LAYOUTS])
def test_moe_in_float16_matches_one_device(name, monkeypatch):
    """fp16 with experts: the auxiliary losses' backward starts from the loss scale, as the
    loss's does (Megatron's MoEAuxLossAutoScaler.set_loss_scale); the dense and the experts'
    engines share one scaler, so an overflow in the experts' gradients alone (planted at step
    2) skips the step for both, on every rank."""
    from playground.data_parallel import ShardedOptimizer
    _experts_overflow_at_step_2(monkeypatch, ShardedOptimizer.step)
    model, axes = FP16_LAYOUTS[name]
    rep = check(_run(model=model, dtype="float16", **axes))
    assert rep.passed, (rep.problems[:2], [r for r in rep.rows if not r.ok][:2])
    assert rep.tolerance["grad"] is not None
    scales = {tuple(s["loss_scale"] for s in v["steps"]) for v in rep.result.values}
    skipped = {tuple(s["skipped"] for s in v["steps"]) for v in rep.result.values}
    assert scales == {(2.0 ** 16, 2.0 ** 16, 2.0 ** 15)} and skipped == {(False, True, False)}, (scales, skipped)


@pytest.mark.sabotage
def test_the_check_catches_fp16_auxiliary_losses_not_loss_scaled(monkeypatch):
    """The layout's auxiliary losses backpropagated from gradient 1 while the loss's starts
    from the scale (the refusal's reason before they were scaled): after unscaling, the
    router's balancing gradient is 2^16 times too small."""
    real = mm._AddAuxLoss.apply

    def unscaled(out, aux, scale=1.0):
        return real(out, aux, 1.0 if threading.current_thread().name.startswith("sim-rank") else scale)
    monkeypatch.setattr(mm._AddAuxLoss, "apply", unscaled)
    rep = check(_run(steps=1, dp=2, ep=2, dtype="float16"))
    assert not rep.passed and "router" in rep.worst("grad").name


@pytest.mark.sabotage
def test_the_check_catches_dense_and_expert_engines_deciding_an_overflow_apart(monkeypatch):
    """Each engine decides an overflow over its own gradients and group: with an overflow in
    the experts' gradients alone the experts skip the step while the dense parameters take it."""
    def apart(self, found_inf=None):
        for e in self.engines:
            e.overflow_groups = [e.group]
            e.step(found_inf)
    _experts_overflow_at_step_2(monkeypatch, apart)
    rep = check(_run(dp=2, ep=2, dtype="float16"))
    assert not rep.passed


# -- the dispatch at unit level -------------------------------------------------------------------
class _Identity(torch.nn.Module):
    def forward(self, x, counts):
        return x.clone()


@pytest.mark.parametrize("ep", [2, 3, 4])
def test_identity_experts_round_trip_returns_the_input_exactly(ep):
    E = 2 * ep

    def fn(world):
        g = torch.Generator().manual_seed(world.rank)
        counts = torch.randint(0, 5, (E,), generator=g)  # uneven, some zero
        x = torch.randn(int(counts.sum()), 8, dtype=torch.float64, generator=g)
        y, none = ExpertParallelDispatch(world, E)(x, counts, _Identity())
        return torch.equal(x, y) and none is None
    assert all(launch(fn, ep).values)


@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("T,k", [(7, 1), (12, 2), (5, 3)])
def test_the_permuted_gather_and_combine_equal_index_select_and_index_add(T, k, given):
    """Where every token of a group is routed k times (static shapes), the experts' gather and
    combine are permutations whose backwards gather (no scatter-add on a GPU): the same
    values and gradients, in float64, as index_select and index_add; their slots found by a
    sort of the tokens, or given by the rows' assignments (a = t·k + j, no sort)."""
    g = torch.Generator().manual_seed(T * k)
    assignments = torch.randperm(T * k, generator=g)
    tokens = assignments // k
    slots = mm.token_slots(tokens, k, assignments if given else None)
    x = torch.randn(T, 6, dtype=torch.float64, generator=g)
    rows = torch.randn(T * k, 6, dtype=torch.float64, generator=g)
    w1, w2 = torch.randn(T * k, 6, dtype=torch.float64, generator=g), torch.randn(T, 6, dtype=torch.float64, generator=g)
    got, want = {}, {}
    for out, gather, combine in ((got, mm.gather_rows, mm.combine_rows),
                                 (want, lambda x, t, k, _: x.index_select(0, t),
                                  lambda r, t, k, _: torch.zeros(T, 6, dtype=r.dtype).index_add(0, t, r))):
        xi, ri = x.clone().requires_grad_(), rows.clone().requires_grad_()
        a, b = gather(xi, tokens, k, slots), combine(ri, tokens, k, slots)
        ((a * w1).sum() + (b * w2).sum()).backward()
        out.update(a=a.detach(), b=b.detach(), gx=xi.grad, gr=ri.grad)
    assert torch.equal(got["a"], want["a"]) and torch.equal(got["gr"], want["gr"])
    for key in ("b", "gx"):  # (sums of k terms, in another order)
        assert torch.allclose(got[key], want[key], rtol=1e-14, atol=1e-15)
    assert torch.autograd.gradcheck(lambda x: mm.gather_rows(x, tokens, k, slots), x.clone().requires_grad_())


@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_float32_scores_rank_in_one_sort_as_two_sorts_do(cf):
    """The ranking of assignments (expert and choice, then score high first, then position)
    takes one stable sort of a 64-bit key where the selection scores are float32 (a GPU's)
    and two stable sorts otherwise: the same order on the same values, with ties, negative
    scores (a balancing bias), zeros of either sign, and the capacity's kept rows."""
    import dataclasses
    cfg = dataclasses.replace(preset("tiny-dsmoe"), capacity_factor=cf)
    g = torch.Generator().manual_seed(3)
    T, E = 64, cfg.n_experts
    probs = torch.randn(T, E, generator=g).mul(4).round().div(8)  # many exact ties
    probs[:, 0] = -0.0
    probs[::3, 1] = 0.0
    probs[1::2] -= 0.25  # negative scores, as a bias gives
    one, two = mm._ranked(probs, cfg), mm._ranked(probs.double(), cfg)
    assert torch.equal(one[1], two[1]) and torch.equal(one[2], two[2])
    assert cf == 0 or torch.equal(one[4], two[4])
    # and the order is what it says: by expert and choice, then score (high first), then position
    e = one[1].reshape(-1)
    key = [(int(e[a]) * cfg.top_k + int(a) % cfg.top_k, -float(one[0].reshape(-1)[a]), int(a)) for a in one[2]]
    assert key == sorted(key)


def test_dropless_output_of_a_rank_does_not_depend_on_the_others_tokens():
    cfg = BASE.with_(capacity_factor=0.0)

    def fn(world, other_seed):
        torch.manual_seed(0)
        layer = MoE(cfg).to(torch.float64)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
        from moe.plan import parallelize_experts
        holder = torch.nn.Module()
        holder.blocks = torch.nn.ModuleDict({"0": torch.nn.Module()})
        holder.blocks["0"].mlp = layer
        parallelize_experts(holder, world)
        seed = 1 if world.rank == 0 else other_seed
        x = torch.randn(2, 8, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        return layer(x).detach()
    a = launch(fn, 2, args=(2,)).values[0]
    b = launch(fn, 2, args=(3,)).values[0]
    assert torch.equal(a, b)


def test_capacity_keeps_first_choices_then_the_most_probable():
    cfg = BASE.with_(n_experts=2, top_k=1, capacity_factor=1.0)  # 4 tokens, 2 experts: 2 slots each
    logits = torch.tensor([[3.0, 0.0], [2.0, 0.0], [4.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    _, r = route(logits, cfg)
    assert r.dropped == 1 and r.counts.tolist() == [2, 1]
    assert sorted(r.tokens[:2].tolist()) == [0, 2]  # token 1 (lowest probability for expert 0) dropped


@pytest.mark.parametrize("E,k", [(8, 2), (64, 8), (6, 3)])
def test_exact_ties_go_to_the_lower_expert_on_every_device(E, k):
    """bf16 logits tie often; the decision must be a function of the scores alone (the check
    replays a GPU layout's decisions on the CPU), so each token's experts are its k highest
    scores with exact ties to the lower index, in order, as a stable sort ranks them.
    torch.topk on the CPU breaks such ties otherwise in most rows, and CUDA's otherwise again."""
    g = torch.Generator().manual_seed(E)
    scores = torch.randint(-1, 3, (500, E), generator=g).float() / 4  # (with a bias scores go below 0)
    scores = torch.where(torch.rand(500, E, generator=g) < 0.5, -scores, scores)  # -0 beside +0: a tie too
    cfg = BASE.with_(n_experts=E, top_k=k, capacity_factor=1.0)
    d = choose(scores, cfg)
    for t in range(scores.shape[0]):
        want = sorted(range(E), key=lambda e: (-scores[t, e].item(), e))[:k]
        assert d.experts[t].tolist() == want, (t, scores[t].tolist())
    assert choose(scores.clone(), cfg).same(d)


@pytest.mark.parametrize("k,renormalize", [(1, None), (2, None), (3, None), (1, True), (2, False)])
def test_gates_are_renormalised_for_k_above_one_and_raw_for_top_1(k, renormalize):
    """GShard's and Mixtral's k > 1: the k gates sum to one; Switch's k = 1: the raw
    probability (renormalised alone it would be exactly 1)."""
    cfg = BASE.with_(n_experts=6, top_k=k, renormalize_gates=renormalize, capacity_factor=0.0)
    logits = torch.randn(40, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
    probs, r = route(logits, cfg)
    per_token = torch.zeros(40, dtype=torch.float64).index_add(0, r.tokens, r.gates)
    top = probs.topk(k, dim=-1).values
    if cfg.renormalizes:
        assert torch.allclose(per_token, torch.ones(40, dtype=torch.float64), rtol=0, atol=1e-15)
    else:
        assert torch.allclose(per_token, top.sum(-1), rtol=0, atol=1e-15) and (per_token < 1).all()


def test_top_1_routing_gives_the_router_the_tasks_gradient():
    """With k = 1 the router learns from the task, not only from the auxiliary losses."""
    cfg = BASE.with_(n_experts=4, top_k=1, aux_loss_coef=0.0, z_loss_coef=0.0)
    model = GPT(cfg, seed=0, dtype=torch.float64)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    model(x[:, :-1], x[:, 1:]).backward()
    grad = model.blocks["0"].mlp.router.weight.grad
    assert grad.abs().max() > 1e-4


def _layout_side(fn, real):
    """`fn` on the simulated ranks' threads (the layout), `real` in the check's reference."""
    return lambda *a: fn(*a) if threading.current_thread().name.startswith("sim-rank") else real(*a)


def _zero_router_and_noisy_layout_logits(monkeypatch, scale=1e-15):
    """Every router starts at zero, so every step-0 decision is an exact tie; the layout's
    logits get noise of `scale` (the last bits of a logit), so it breaks the ties otherwise."""
    import model.init as init
    real_init = init.init_full_parameter
    monkeypatch.setattr(init, "init_full_parameter", lambda name, shape, config, seed: torch.zeros(
        shape, dtype=torch.float64) if "router" in name else real_init(name, shape, config, seed))
    _perturb_layout_logits(monkeypatch, lambda out, g: out + scale * torch.randn(out.shape, generator=g,
                                                                                dtype=out.dtype))


def _perturb_layout_logits(monkeypatch, perturb):
    """The router logits of every layout rank's MoE call (not the reference's) replaced by
    perturb(logits, generator), the generator seeded by the layer and the call."""
    real_forward = MoE.forward

    def perturbed(self, x):
        if self.groups is not None:  # the reference
            return real_forward(self, x)
        g = torch.Generator().manual_seed(len(self.stats.decisions) * 1000 + self.index)
        hook = self.router.register_forward_hook(lambda module, args, out: perturb(out, g))
        try:
            return real_forward(self, x)
        finally:
            hook.remove()
    monkeypatch.setattr(MoE, "forward", perturbed)


TIES = {"dp2-ep2-E4-k2": dict(dp=2, ep=2), "dp4-ep4-E8-k2": dict(dp=4, ep=4, model=BASE.with_(n_experts=8)),
        "ep2-tp2-sp-k1": dict(dp=2, tp=2, sequence_parallel=True, ep=2, model=BASE.with_(top_k=1)),
        "pp2-ep2-dropless": dict(pp=2, dp=2, ep=2, microbatches=4, model=BASE.with_(capacity_factor=0.0))}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("dp4-ep4-E8-k2", "ep2-tp2-sp-k1") else n
                                  for n in TIES])
def test_near_ties_broken_otherwise_by_the_layout_are_replayed_and_pass(name, monkeypatch):
    """A verdict must not depend on the last bit of a router logit: at exact ties broken
    otherwise on the layout's side, the reference replays the layout's decisions."""
    _zero_router_and_noisy_layout_logits(monkeypatch)
    rep = check(_run(**TIES[name]))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
    assert rep.ties > 0 and rep.tied > 0


@pytest.mark.parametrize("name", ["ep2-E4-k2", pytest.param("ep4-E8-k2", marks=pytest.mark.slow), "ep2-E8-k1",
                                  pytest.param("dp2-tp2-pp2-ep2-sp", marks=pytest.mark.slow)])
def test_layouts_pass_with_their_router_logits_a_few_ulps_off(name, monkeypatch):
    """The layout's router logits moved by up to 4 units in their last place (as another
    machine's rounding moves them): the verdict stays PASS."""
    def off(logits, g):
        ulps = torch.randint(-4, 5, logits.shape, generator=g).to(logits.dtype)
        return logits + ulps * logits.abs() * torch.finfo(logits.dtype).eps / 2
    _perturb_layout_logits(monkeypatch, off)
    rep = check(_run(**CASES[name]))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


# -- sabotage ---------------------------------------------------------------------------------------
@pytest.mark.sabotage
def test_ties_not_replayed_fail(monkeypatch):
    """The same ties without the replay (a tolerance of 0 for the router probabilities): the
    reference routes otherwise and the check fails, so the test above can fail."""
    _zero_router_and_noisy_layout_logits(monkeypatch)
    real = mm.Replay.__init__
    monkeypatch.setattr(mm.Replay, "__init__", lambda self, groups, tolerance: real(self, groups, 0.0))
    rep = check(_run(steps=1, **TIES["dp2-ep2-E4-k2"]))
    assert not rep.passed and any("routing" in p for p in rep.problems)


def _half_capacity(ranked, probs, c):
    return ranked(probs, c.with_(capacity_factor=c.capacity_factor / 2))


def _lowest_probability_kept(ranked, probs, c):
    """Each expert keeps the last of its assignments in priority order instead of the first:
    each expert's run of the expert-major order reversed (the runs keep their lengths, so
    `within` still marks each run's first C places)."""
    top, expert, order, routed, within = ranked(probs, c)
    e = expert.reshape(-1)[order]
    start = torch.cumsum(routed, 0) - routed
    place = start[e] + (start[e] + routed[e] - 1 - torch.arange(order.numel()))  # mirrored within its run
    return top, expert, order[place], routed, within


@pytest.mark.sabotage
@pytest.mark.parametrize("bug", [_half_capacity, _lowest_probability_kept], ids=["capacity", "drop-order"])
@pytest.mark.parametrize("ep", [1, 2])
def test_the_check_catches_a_layout_that_routes_by_another_rule(bug, ep, monkeypatch):
    """The layout's ranks apply a wrong capacity or drop the wrong assignments, in the
    routing they compute with (in static shapes, on local experts or through the padded
    dispatch): their decisions are not what the rule gives on their own probabilities, a
    routing problem."""
    real = mm._ranked
    monkeypatch.setattr(mm, "_ranked", _layout_side(lambda probs, c: bug(real, probs, c), real))
    rep = check(_run(steps=1, dp=2, ep=ep))
    assert not rep.passed and any("not what its own scores give" in p for p in rep.problems)


@pytest.mark.sabotage
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_check_judges_the_static_routing_that_training_runs(dtype, monkeypatch):
    """The routing in static shapes (what training computes with at a capacity on the local
    experts) forgets to zero its dropped rows' gates: a dropped assignment adds its expert's
    output to its token. The decisions are right, the outputs are not: the check, whose
    layout runs the same routing, fails on the gradients. (The padded dispatch reads a
    dropped row from a zero slot, whatever its gate.)"""
    real = mm.static_routing

    def dropped_rows_kept(scores, selection, c):
        r = real(scores, selection, c)
        gates = mm._gates(scores, r.chosen, c).reshape(-1).index_select(0, r.assignments)
        return mm.Routing(r.tokens, gates, r.counts, r.routed, r.dropped, r.chosen, r.assignments)
    monkeypatch.setattr(mm, "static_routing", dropped_rows_kept)
    rep = check(_run(steps=1, dp=2, dtype=dtype))
    assert _dropped(rep) > 0 and not rep.passed and rep.worst("grad").ratio > 10


# -- sabotage (expert parallelism) ------------------------------------------------------------------
@pytest.mark.sabotage
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_check_catches_expert_gradients_averaged_by_the_smaller_group(dtype, monkeypatch):
    """Dividing by the expert-data-parallel group's size only (grad_scale 1 instead of 1/ep)
    gives expert gradients ep times too large (in bf16 the experts' ZeRO engine's)."""
    import playground.data_parallel as par
    real, real_zero = par.DistributedDataParallel, par.ZeroDataParallel
    monkeypatch.setattr(par, "DistributedDataParallel", lambda *a, grad_scale=1.0, **k: real(*a, **k))
    monkeypatch.setattr(par, "ZeroDataParallel", lambda *a, grad_scale=1.0, **k: real_zero(*a, **k))
    rep = check(_run(steps=1, dp=2, ep=2, dtype=dtype))
    assert not rep.passed
    worst = rep.worst("grad")
    assert "experts" in worst.name and worst.max_rel > 0.5


@pytest.mark.sabotage
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_the_check_catches_a_token_sent_to_the_wrong_expert(capacity_factor, monkeypatch):
    """The receiving rank hands its experts each other's tokens: dropless, it cuts them into
    its experts' batches with the counts in the wrong order; at a capacity (the padded
    dispatch), each expert's ep·C rows go to the next expert."""
    import moe.dispatch as d
    real, real_padded = d.ExpertParallelDispatch.__call__, d.ExpertParallelDispatch.padded

    def misrouted(self, x, counts, experts, during=None):
        return real(self, x, counts, lambda tokens, per_expert: experts(tokens, per_expert[::-1]), during)

    def misrouted_padded(self, x, capacity, experts, during=None):
        def swapped(rows, per_expert):
            y = experts(rows.reshape(self.local, -1, rows.shape[1]).roll(1, 0).reshape(rows.shape), per_expert)
            return y.reshape(self.local, -1, y.shape[1]).roll(-1, 0).reshape(y.shape)
        return real_padded(self, x, capacity, swapped, during)
    monkeypatch.setattr(d.ExpertParallelDispatch, "__call__", misrouted)
    monkeypatch.setattr(d.ExpertParallelDispatch, "padded", misrouted_padded)
    rep = check(_run(steps=1, dp=2, ep=2, model=BASE.with_(n_experts=8, capacity_factor=capacity_factor)))
    assert not rep.passed and rep.worst("loss").max_rel > 1e-6


@pytest.mark.sabotage
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_check_catches_router_gradients_not_summed_over_tensor_parallel_slices(dtype, monkeypatch):
    import tensor_parallel.plan as plan
    monkeypatch.setattr(plan, "copy_to_tp", lambda w, group, label: w if "router" in label else
                        plan.__dict__["_copy"](w, group, label))
    from tensor_parallel.mappings import copy_to_tp
    monkeypatch.setitem(plan.__dict__, "_copy", copy_to_tp)
    rep = check(_run(steps=1, dp=2, tp=2, sequence_parallel=True, ep=2, dtype=dtype))
    assert not rep.passed and "router" in rep.worst("grad").name


# -- ledger -----------------------------------------------------------------------------------------
def test_all_to_all_bytes_are_the_tokens_routed_off_the_rank(monkeypatch):
    """Dropless, per rank, layer and microbatch: the dispatch sends exactly the assignments
    routed to experts on other ranks × d × element size (the combine sends them back), and
    the counts exchange is an all-to-all of E integers under its own label."""
    import threading

    import model.moe as mm
    real = mm.static_route
    seen: dict = {}

    def spy(logits, bias, c):
        out = real(logits, bias, c)
        seen.setdefault(threading.current_thread().name, []).append(out[3].clone())  # the counts
        return out
    monkeypatch.setattr(mm, "static_route", spy)
    model = BASE.with_(capacity_factor=0.0)
    ep, E, d, L = 2, model.n_experts, model.d_model, model.n_layers
    res = train(_run(dtype="float32", steps=2, dp=2, ep=ep, model=model))
    for r in range(2):
        counts = seen[f"sim-rank-{r}"]  # per microbatch, per layer, in order
        mine = range(r * E // ep, (r + 1) * E // ep)
        expected = [sum(int(c[e]) for e in range(E) if e not in mine) * d * 4 for c in counts]
        entries = res.ledger.for_rank(r)
        dispatch = [e.bytes_sent for e in entries if e.label == "moe.dispatch"]
        # per microbatch: L forward dispatches, then the L backward ones (the transposed all-to-all)
        forward = [b for i, b in enumerate(dispatch) if i % (2 * L) < L]
        assert forward == expected and len(dispatch) == 2 * len(expected)
        exchanges = [e for e in entries if e.label == "moe.counts"]
        assert len(exchanges) == len(counts) and {e.size for e in exchanges} == {E * 8}


def test_at_a_capacity_the_all_to_alls_are_even_and_exchange_no_counts():
    """With a capacity C (GShard): each rank sends every other rank its experts' C slots each,
    padding included, (ep − 1)·E/ep·C rows × d × element size a dispatch and a combine, and
    exchanges no counts (nothing for the host to wait for)."""
    from model.moe import capacity
    ep, E, d, L = 2, BASE.n_experts, BASE.d_model, BASE.n_layers
    res = train(_run(dtype="float32", steps=2, dp=2, ep=ep))
    C = capacity(BASE, 2 * BASE.seq_len)  # (micro-batch 2: the tokens one rank routes in a call)
    for r in range(2):
        entries = res.ledger.for_rank(r)
        for label in ("moe.dispatch", "moe.combine"):
            sent = {e.bytes_sent for e in entries if e.label == label}
            assert sent == {(ep - 1) * E // ep * C * d * 4}, (label, sent)
        assert not [e for e in entries if e.label == "moe.counts"]
        assert len([e for e in entries if e.label == "moe.dispatch"]) == 2 * 2 * 2 * L  # fwd + bwd, 2 mb, 2 steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the regions are compiled on a GPU only")
def test_the_padded_dispatch_regions_compiled_on_a_gpu_give_what_the_cpu_does():
    """The padded dispatch's regions around the all-to-alls (`to_slots`, `from_slots`), as
    torch.compile runs them on a GPU, against the same ops op by op on the CPU in float32:
    the slots, the routed output and the gradients of the tokens and the gates."""
    from model.moe import capacity, from_slots, static_route, to_slots
    c = BASE.with_(n_experts=8)
    g = torch.Generator().manual_seed(0)
    T, d = 64, c.d_model
    x0, logits0 = torch.randn(T, d, generator=g), torch.randn(T, c.n_experts, generator=g)
    w0 = torch.randn(d, d, generator=g)
    C = capacity(c, T)
    out = {}
    for device in ("cpu", "cuda"):
        x = x0.to(device, copy=True).requires_grad_()
        logits = logits0.to(device, copy=True).requires_grad_()
        _, tokens, gates, counts, routed, dropped, chosen, assignments = static_route(logits, None, c)
        slots, slot = mm.region("moe_pad", 0, to_slots, x, tokens, chosen, assignments, routed, dropped,
                                c.n_experts, c.top_k, C)
        y = mm.region("moe_unpad", 0, from_slots, slots @ w0.to(device), slot, gates, tokens, assignments, c.top_k)
        y.pow(2).sum().backward()
        out[device] = [t.detach().cpu() for t in (slots, slot, y, x.grad, logits.grad)]
    for name, a, b in zip(("slots", "slot", "output", "token grad", "gate grad"), out["cpu"], out["cuda"]):
        # float32 rounding apart, relative to each tensor's largest element (on an H200: 3e-7)
        assert (b.double() - a.double()).abs().max() <= 1e-5 * a.double().abs().max(), name


# -- running ----------------------------------------------------------------------------------------
def test_simulated_time_counts_every_step_of_an_moe_run(capsys):
    run = RunConfig(model=BASE, layout=Layout(dp=2, ep=2, micro_batch_size=2), steps=4, hardware="h100-sxm",
                    progress=False)
    res = train(run)
    assert "every step's ops are counted" in capsys.readouterr().err
    assert all(len(v["sim_steps"]) == 4 for v in res.values)
    assert res.moe_steps()[-1][0]["assignments"] == 2 * 2 * BASE.seq_len * BASE.top_k


@pytest.mark.parametrize("layout,message", [
    (Layout(dp=3, ep=3), r"n_experts=4 is not divisible by ep=3"),
    (Layout(dp=2, ep=4), r"ep=4 must divide dp·cp = 2·1 = 2"),
    (Layout(tp=2, dp=2, ep=2), r"tp=2 with experts needs --sp"),
])
def test_moe_layouts_that_do_not_fit(layout, message):
    with pytest.raises(LayoutError, match=message):
        layout.validate(BASE)


def test_moe_parameters_and_flops_formulas():
    c = preset("tiny-moe")
    assert c.n_params() == sum(p.numel() for p in GPT(c, device="meta").parameters())


def test_the_grouped_gemm_experts_equal_the_loop(monkeypatch):
    """The experts as three grouped GEMMs (the GPU path: torch._grouped_mm over the experts'
    token ranges) give the loop's outputs and gradients, in bf16, with an expert given no
    token; the counts stay a device tensor (no host read)."""
    import model.moe as moe_module
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    torch.manual_seed(0)
    experts = moe_module.Experts(4, 16, 24).to(torch.bfloat16)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(21, 16, dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([5, 0, 9, 7])

    def run(grouped):
        monkeypatch.setattr(moe_module, "grouped_mm_applies", lambda x, w: grouped)
        for p in (x, *experts.parameters()):
            p.grad = None
        y = experts(x, counts)
        (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        return y.detach().float(), [p.grad.float() for p in (x, *experts.parameters())]
    try:
        y_g, g_g = run(True)
    except RuntimeError as e:  # (a CPU build without the kernel)
        pytest.skip(f"torch._grouped_mm does not run here: {e}")
    y_l, g_l = run(False)
    assert torch.allclose(y_g, y_l, rtol=2e-2, atol=2e-2)
    for a, b in zip(g_g, g_l):
        assert torch.allclose(a, b, rtol=3e-2, atol=3e-2)


def test_expert_counts_are_bincount_without_reading_the_device():
    from model.moe import _count
    e = torch.randint(0, 7, (1000,))
    assert torch.equal(_count(e, 9), torch.bincount(e, minlength=9))


def test_a_layers_record_stays_on_the_device_until_read():
    """MoEStats keeps the calls' losses and counts as they are; `resolved` sums and reads
    them once, `loss` sums the losses without reading them."""
    from model.moe import MoEStats
    st = MoEStats()
    for routed, aux in ((torch.tensor([3, 1, 0]), torch.tensor(0.25)), (torch.tensor([1, 1, 2]), torch.tensor(0.5))):
        st.calls.append((aux, aux / 10, routed, 1))
    assert isinstance(st.loss("cpu"), torch.Tensor) and st.loss("cpu").item() == pytest.approx(0.825)
    r = st.resolved()
    assert (r.aux, r.z, r.routed, r.assignments, r.dropped) == (0.75, pytest.approx(0.075), [4, 2, 2], 8, 2)
    assert not r.calls


def test_a_plan_routes_with_the_ops_a_gpu_runs():
    """On meta (a plan) the router runs the same ops as on real data, with balanced counts:
    the top-k, the sorts, the counts, the gates; only the mask of the kept assignments,
    which needs the values, is a slice there."""
    import collections
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops[func._overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))
    cfg = preset("tiny-moe")
    counted = {}
    for device in ("cpu", "meta"):
        logits = torch.randn(48, cfg.n_experts) if device == "cpu" else torch.empty(48, cfg.n_experts, device="meta")
        with Count() as c:
            probs, r = route(logits, cfg)
        counted[device] = c.ops
        assert r.tokens.numel() == r.gates.numel() and int(r.counts.sum()) == r.tokens.numel() or device == "cpu"
    assert counted["cpu"] - counted["meta"] <= collections.Counter({"index": 1})


def test_a_plan_reads_compute_copies_of_the_experts_once_and_casts_fp32_ones():
    """The compiled layer's bytes in a plan: bf16 expert weights (compute copies) read once,
    2 bytes an element; fp32 ones under autocast read (4) and their bf16 casts written and read
    (2 + 2): 18 bytes an element of the three weights more."""
    from simulator.clock import RankClock
    from simulator.compute_model import ComputeModel
    from simulator.hardware import load_hardware
    cfg = preset("tiny-moe").with_(seq_len=64)
    moved = {}
    for dtype in (torch.bfloat16, torch.float32):
        layer = MoE(cfg).to(device="meta", dtype=dtype)
        x = torch.empty(2, 64, cfg.d_model, device="meta", dtype=torch.bfloat16, requires_grad=True)
        model = ComputeModel(load_hardware("h100-sxm"), RankClock())
        model.by_op = {}
        with model, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32):
            layer(x)
        moved[dtype] = model.by_op["moe_layer"][2]
    assert moved[torch.float32] - moved[torch.bfloat16] == 18 * layer.experts.w_gate.numel()


def test_a_plan_of_a_checkpointed_moe_block_recomputes_its_forward_once():
    """A plan prices the MoE layer's compiled regions' backward through an autograd graph of
    their own (model/compiled.py), which torch.utils.checkpoint would recompute apart from
    the block's: twice under full recomputation, refused under a selective policy. In a
    checkpointed block the regions' backward is priced op by op instead: every mode plans,
    and full recomputation adds one forward, under a third of the step's compute without it
    (a backward is about twice its forward)."""
    from playground.planning import plan
    compute = {}
    for ac in ("none", "full", "selective", "selective-op"):
        p = plan(RunConfig(model=preset("tiny-moe"), layout=Layout(micro_batch_size=2, ac=ac), dtype="bfloat16",
                           hardware="h200", progress=False))
        compute[ac] = p.values[0]["step"]["compute"]
    assert compute["none"] < compute["selective"] < compute["full"] < 4 / 3 * compute["none"], compute


@pytest.mark.parametrize("cf", [0.5, 1.0, 1.25])
@pytest.mark.parametrize("router", ["softmax", "topk_softmax", "sigmoid"])
def test_routing_in_static_shapes_equals_routing_the_kept_rows(cf, router, monkeypatch):
    """With a capacity, the local experts route all T·k assignments (the dropped ones last,
    with gate 0) instead of the kept rows alone, so nothing waits for the host: the layer's
    output, every gradient and the dropped count are those of the compact routing (`route`,
    the check's reference's), with each router and a balancing bias; and the decision the
    layer keeps for the check (`record`) is the one `choose` makes on its selection scores."""
    import dataclasses
    cfg = dataclasses.replace(preset("tiny-moe"), capacity_factor=cf, router=router, bias_update_rate=1e-3)
    torch.manual_seed(0)
    layer = MoE(cfg).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.expert_bias = torch.linspace(-0.05, 0.05, cfg.n_experts, dtype=torch.float64)
    x = torch.randn(3, 16, cfg.d_model, dtype=torch.float64)
    real = mm.static_route

    def compact(logits, bias, c):
        scores, r = mm.route(logits, c, bias)
        return scores, r.tokens, r.gates, r.counts, r.routed, r.dropped, r.chosen, r.assignments
    got = {}
    for static in (False, True):
        monkeypatch.setattr(mm, "static_route", real if static else compact)
        layer.record, layer.stats = static, mm.MoEStats()
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
        got[static] = (y.detach(), xi.grad, [p.grad for p in layer.parameters()], layer.stats.resolved())
    (y1, gx1, gp1, st1), (y2, gx2, gp2, st2) = got[False], got[True]
    assert st1.dropped == st2.dropped and st1.routed == st2.routed and (cf > 1 or st1.dropped > 0)
    assert torch.allclose(y1, y2, rtol=1e-13, atol=1e-15) and torch.allclose(gx1, gx2, rtol=1e-12, atol=1e-14)
    for a, b in zip(gp1, gp2):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    (chosen_by, decision), = layer.stats.decisions
    assert decision.same(choose(chosen_by, cfg)) and decision.kept.numel() == 3 * 16 * cfg.top_k - st2.dropped


@pytest.mark.slow
@pytest.mark.parametrize("cf", [0.0, 1.0])
@pytest.mark.parametrize("record", [False, True], ids=["training", "under-the-check"])
def test_the_regions_a_gpu_compiles_compile_whole_and_equal_the_eager_layer(cf, record, monkeypatch):
    """What a GPU runs through torch.compile (the routing in static shapes, the balancing
    losses, the local experts' gather, grouped GEMMs and combine) compiles as one graph each
    (fullgraph: a graph break would fall back to op by op, silently slower), here on the CPU,
    and so does the whole layer as one region (`whole_layer`, where nothing is exchanged with
    other ranks); the layer's output and gradients, eager or compiled, equal those of the
    CPU's path (a loop over the experts, an index_select and an index_add), in bf16. Under the
    check (`record`) every path runs so too and keeps the decision it routed by: the same
    one."""
    import dataclasses

    import model.compiled as compiled_module
    import model.moe as moe_module
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    cfg = dataclasses.replace(preset("tiny-dsmoe"), capacity_factor=cf, aux_loss="batch", aux_loss_coef=0.01)
    torch.manual_seed(0)
    layer = MoE(cfg).to(torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.expert_bias = torch.linspace(-0.01, 0.01, cfg.n_experts)
    layer.aux_scale = 0.5  # (gradient accumulation's weight, which the whole layer applies inside)
    x = torch.randn(2, 16, cfg.d_model, dtype=torch.bfloat16)
    got = {}
    for fused in ("loop", False, True, "whole"):  # the CPU's loop over the experts, then what a GPU runs
        monkeypatch.setattr(moe_module, "grouped_mm_applies", lambda x, w: fused != "loop")
        monkeypatch.setattr(compiled_module, "fused_on", lambda fn, t: torch.compile(fn, fullgraph=True, dynamic=False)
                            if fused is True or fused == "whole" else fn)  # (what model.compiled.region runs)
        monkeypatch.setattr(moe_module.MoE, "_whole_on_gpu", lambda self, flat: fused == "whole")
        layer.stats, layer.record = mm.MoEStats(), record
        for p in layer.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        try:
            y = layer(xi)
        except RuntimeError as e:  # (a CPU build without the kernel)
            if "grouped" not in str(e):
                raise
            pytest.skip(f"torch._grouped_mm does not run here: {e}")
        (y.float() * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        got[fused] = (y.detach().float(), xi.grad.float(), [p.grad.float() for p in layer.parameters()],
                      layer.stats.resolved())
        assert len(layer.stats.decisions) == record
        if record:
            decisions = got.setdefault("decisions", [])
            decisions.append(layer.stats.decisions[0])
    for chosen_by, decision in got.get("decisions", []):
        assert decision.same(got["decisions"][0][1]) and decision.same(choose(chosen_by, cfg))
    y1, gx1, gp1, st1 = got["loop"]

    def close(a, b, rel):  # bf16 rounding, at the scale of the tensor's largest entry
        return torch.allclose(a, b, rtol=rel, atol=rel * float(a.abs().max()))
    for y2, gx2, gp2, st2 in (got[False], got[True], got["whole"]):
        assert st1.routed == st2.routed and st1.dropped == st2.dropped
        assert st1.aux == pytest.approx(st2.aux, rel=2e-2) and st1.z == pytest.approx(st2.z, rel=2e-2)
        assert close(y1, y2, 2e-2) and close(gx1, gx2, 3e-2)
        for a, b in zip(gp1, gp2):
            assert close(a, b, 3e-2)


def test_zero3_experts_under_selective_checkpointing_in_bfloat16():
    """ZeRO-3's experts' units gather inside the checkpointed block: in the forward a unit was
    prefetched by the one before, in the recomputation it is gathered on demand. The simulated
    collectives' look at a bf16 buffer (a view as int16, for NumPy) is not an op of the rank's
    program: seen by the selective policy's caching mode, the recomputation met more of them
    than its forward had ("invocation index ... not found in storage")."""
    rep = check(RunConfig(model=preset("tiny-moe"), layout=Layout(dp=2, zero=3, ep=2, ac="selective"),
                          dtype="bfloat16", steps=2, progress=False))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
