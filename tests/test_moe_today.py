"""Today's MoE options (DeepSeekMoE's fine-grained and shared experts; DeepSeek-V3's sigmoid
router and auxiliary-loss-free bias; its sequence-wise balance loss; Mixtral's top-k-then-
softmax router): each against one device in float64 on ep 1, 2, 4 and composed with dp,
tp+sp, pp, cp and ZeRO; the rules at unit level; the bias in checkpoints; and sabotages
that must fail (a bias moved by one rank's own counts, shared experts reduced as experts)."""
import threading

import pytest
import torch

import model.moe as mm
from model import GPT, preset
from model.moe import MoE, MoEStats, balance_losses, route, router_scores, sequence_counts
from playground import Layout, RunConfig, check, train

BASE = preset("tiny-moe", vocab_size=61)  # 2 blocks, both MoE, 4 experts, top-2, capacity factor 1
DSMOE = preset("tiny-dsmoe", vocab_size=61)  # 8 experts of width 48, top-2, 1 shared, sigmoid, bias, dropless

OPTIONS = {
    "shared-fine": BASE.with_(n_shared_experts=1, expert_d_ff=24),
    "bias": BASE.with_(bias_update_rate=0.001),
    "topk-softmax": BASE.with_(router="topk_softmax"),
    "sigmoid": BASE.with_(router="sigmoid"),
    "sequence-aux": BASE.with_(aux_loss="sequence"),
    "dsmoe": DSMOE,
}
LAYOUTS = {
    "ep1": dict(dp=2),
    "ep2": dict(dp=2, ep=2),
    "ep4": dict(dp=4, ep=4),
    "dp4-ep2": dict(dp=4, ep=2),
    "tp2-sp-ep2": dict(dp=2, tp=2, sequence_parallel=True, ep=2),
    "pp2-ep2": dict(pp=2, dp=2, ep=2, microbatches=4),
    "cp2-ep2": dict(cp=2, ep=2),
    "zero3-ep2": dict(dp=2, ep=2, zero=3),
    "zero1-dp2-cp2-ep4": dict(dp=2, cp=2, ep=4, zero=1),
}
# the default run: the preset that has every option on one layout per axis, and every option alone at
# ep 2 (the slow tier runs every option on every layout)
FAST = {("dsmoe", "cp2-ep2")} | {(option, "ep2") for option in OPTIONS}  # (the default tier; the rest slow)


def _run(model, dtype="float64", steps=3, microbatches=2, **axes):
    return RunConfig(model=model, layout=Layout(microbatches=microbatches, micro_batch_size=2, **axes), steps=steps,
                     dtype=dtype, progress=False)


@pytest.mark.parametrize("option,layout", [pytest.param(o, lay, marks=() if (o, lay) in FAST else pytest.mark.slow)
                                           for o in OPTIONS for lay in LAYOUTS])
def test_option_matches_one_device(option, layout):
    model = OPTIONS[option]
    if model.n_experts % LAYOUTS[layout].get("ep", 1):
        pytest.skip("ep does not divide the experts")  # (none today: every option has 4 or 8 experts)
    rep = check(_run(model, **LAYOUTS[layout]))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
    assert rep.worst("loss").max_rel < 1e-14 and rep.worst("grad").max_rel < 1e-12
    if model.bias_update_rate:  # the biases moved, and are compared after every step
        biases = [r for r in rep.rows if r.what == "bias"]
        assert len(biases) == model.n_moe_layers and all(r.ratio is not None for r in biases)
        final = rep.result.moe_steps()[-1]
        assert any(b != 0 for st in final.values() for b in st["bias"])


@pytest.mark.slow
def test_the_options_in_float32():
    rep = check(_run(DSMOE, dtype="float32", dp=2, ep=2))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


# -- the rules at unit level ------------------------------------------------------------------------
def _logits(T=40, E=6, seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_topk_softmax_gates_are_a_softmax_over_the_chosen_logits():
    """Mixtral: G = softmax(top-k(logits)), equal to softmax's renormalised top-k up to rounding."""
    cfg = BASE.with_(n_experts=6, top_k=2, router="topk_softmax", capacity_factor=0.0)
    logits = _logits()
    _, r = route(logits, cfg)
    top, experts = logits.topk(2, dim=-1)
    want = torch.softmax(top, dim=-1)
    got = torch.zeros_like(want)
    a = r.chosen  # (T, k) in choice order; the routing's rows are expert-major: find each (token, expert)
    for t, e, g in zip(r.tokens.tolist(), torch.repeat_interleave(torch.arange(6), r.counts).tolist(), r.gates):
        got[t, (a[t] == e).nonzero()[0, 0]] = g
    assert torch.equal(a, experts) and torch.allclose(got, want, rtol=1e-14, atol=0)
    _, softmax = route(logits, cfg.with_(router="softmax"))
    assert torch.allclose(r.gates, softmax.gates, rtol=1e-14, atol=0)


def test_sigmoid_router_scores_and_normalised_gates():
    cfg = BASE.with_(n_experts=6, top_k=3, router="sigmoid", capacity_factor=0.0)
    logits = _logits()
    scores, r = route(logits, cfg)
    assert torch.equal(scores, torch.sigmoid(logits))
    per_token = torch.zeros(logits.shape[0], dtype=torch.float64).index_add_(0, r.tokens, r.gates)
    assert torch.allclose(per_token, torch.ones_like(per_token), rtol=1e-14)
    raw = route(logits, cfg.with_(renormalize_gates=False))[1]
    assert torch.equal(raw.gates, torch.sigmoid(logits)[raw.tokens, torch.repeat_interleave(torch.arange(6),
                                                                                             raw.counts)])


def test_the_bias_moves_the_choice_and_never_the_gates():
    """A bias large enough for one expert takes every token's first choice there; the gates
    stay the router's scores (normalised), and the bias gets no gradient."""
    cfg = BASE.with_(n_experts=6, top_k=2, router="sigmoid", capacity_factor=0.0)
    logits = _logits().requires_grad_()
    bias = torch.zeros(6, dtype=torch.float64)
    bias[4] = 10.0
    scores, r = route(logits, cfg, bias)
    assert (r.chosen[:, 0] == 4).all() and int(r.counts[4]) == logits.shape[0]
    s = torch.sigmoid(logits.detach())
    top = s.gather(1, r.chosen)
    want = (top / top.sum(-1, keepdim=True))
    got = torch.zeros_like(want)
    for t, e, g in zip(r.tokens.tolist(), torch.repeat_interleave(torch.arange(6), r.counts).tolist(), r.gates):
        got[t, (r.chosen[t] == e).nonzero()[0, 0]] = g.detach()
    assert torch.allclose(got, want, rtol=1e-14)
    r.gates.sum().backward()
    assert logits.grad is not None and not bias.requires_grad


def test_bias_update_is_gamma_times_the_sign_of_mean_minus_load():
    layer = MoE(BASE.with_(n_experts=4, bias_update_rate=0.25)).double()
    layer.expert_bias = torch.tensor([0.0, 1.0, -1.0, 0.5], dtype=torch.float64)
    layer._add_load(torch.tensor([3, 5, 2, 6]))  # mean 4
    layer._add_load(torch.tensor([5, 3, 2, 2]))  # summed: 8, 8, 4, 8; mean 7
    layer.update_bias()
    assert layer.expert_bias.tolist() == [-0.25, 0.75, -0.75, 0.25] and layer.load is None
    assert layer.stats.bias.tolist() == [-0.25, 0.75, -0.75, 0.25]
    layer._add_load(torch.tensor([1, 1, 1, 1]))  # balanced: no move
    layer.update_bias()
    assert layer.expert_bias.tolist() == [-0.25, 0.75, -0.75, 0.25]


@pytest.mark.parametrize("axes", [dict(dp=2), pytest.param(dict(dp=2, zero=1), marks=pytest.mark.slow),
                                  dict(dp=2, zero=3, ep=2), pytest.param(dict(pp=2), marks=pytest.mark.slow)],
                         ids=["copies", "zero1", "zero3-ep2", "pp2"])
def test_the_bias_stays_float32_beside_bf16_compute_copies(axes):
    """The compute copies' engine casts the model's floating buffers to bf16 (the RoPE tables),
    but not the balancing bias: in bf16 its steps of γ round away (its spacing is 2^-8 at 0.5,
    where a step of 1e-3 is lost). After one step each moved expert's bias is float32's γ,
    not bf16's (0.00099945)."""
    from playground import train
    res = train(RunConfig(model=DSMOE, layout=Layout(micro_batch_size=2, microbatches=2, **axes), steps=1,
                          dtype="bfloat16", progress=False))
    gamma = torch.tensor(DSMOE.bias_update_rate, dtype=torch.float32).item()
    biases = [layer["bias"] for layer in res.moe_steps()[0].values()]
    assert biases and all(abs(b) in (0.0, gamma) for bias in biases for b in torch.as_tensor(bias).tolist())
    assert any(b != 0.0 for bias in biases for b in torch.as_tensor(bias).tolist())


def test_recomputation_does_not_count_the_load_twice():
    layer = MoE(BASE.with_(bias_update_rate=0.1))
    layer.recomputing = True
    layer._add_load(torch.tensor([9, 0, 0, 0]))
    assert layer.load is None


def test_sequence_wise_balance_loss_is_the_mean_over_sequences_of_f_times_p():
    """DeepSeek-V3 eqs. 17-20 written out: per sequence f_i = E/(k·T)·count_i and P_i the
    mean normalised score, α·Σ_i f_i·P_i averaged over the sequences."""
    cfg = BASE.with_(n_experts=4, top_k=2, router="sigmoid", aux_loss="sequence", aux_loss_coef=0.5,
                     capacity_factor=0.0)
    rows, T = 3, 10
    logits = _logits(rows * T, 4)
    scores, r = route(logits, cfg)
    counts = sequence_counts(r.chosen, rows, 4)
    assert counts.sum(-1).tolist() == [T * 2] * rows
    aux, _ = balance_losses(logits, scores, counts, cfg)
    want = 0.0
    for s in range(rows):
        chosen = r.chosen[s * T:(s + 1) * T]
        f = torch.stack([(chosen == i).sum() for i in range(4)]).double() * 4 / (2 * T)
        norm = scores[s * T:(s + 1) * T] / scores[s * T:(s + 1) * T].sum(-1, keepdim=True)
        want += 0.5 * (f * norm.mean(0)).sum() / rows
    assert torch.allclose(aux, want, rtol=1e-14)


def test_shared_experts_are_added_to_every_token():
    cfg = BASE.with_(n_shared_experts=2, expert_d_ff=8, capacity_factor=0.0)
    model = GPT(cfg, dtype=torch.float64)
    layer = model.moe_layers()[0]
    assert tuple(layer.shared.w_gate.weight.shape) == (16, cfg.d_model)
    assert tuple(layer.experts.w_gate.shape) == (cfg.n_experts, 8, cfg.d_model)
    x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        with_shared = layer(x)
        shared = layer.shared(x)
        layer.shared = None
        alone = layer(x)
    assert torch.allclose(with_shared, alone + shared, rtol=1e-14, atol=1e-16)
    assert cfg.n_params() == sum(p.numel() for p in GPT(cfg, device="meta").parameters())
    assert DSMOE.n_params() == sum(p.numel() for p in GPT(DSMOE, device="meta").parameters())


def test_presets_of_todays_shape():
    big = preset("1b-dsmoe")
    assert (big.n_experts, big.top_k, big.n_shared_experts, big.d_model, big.router) == (16, 4, 1, 1024, "sigmoid")
    assert 0.9e9 < big.n_params() < 1.1e9 and big.bias_update_rate == 0.001 and big.aux_loss == "sequence"


def test_config_errors_name_the_values():
    for kw, message in ((dict(router="top1"), "router='top1'"), (dict(aux_loss="token"), "aux_loss='token'"),
                        (dict(bias_update_rate=-1.0), "bias_update_rate=-1.0"),
                        (dict(router="topk_softmax", renormalize_gates=False), "contradicts")):
        with pytest.raises(ValueError, match=message):
            BASE.with_(**kw)


# -- checkpoints ------------------------------------------------------------------------------------
def test_the_bias_is_in_checkpoints_and_a_resumed_run_is_bitwise_the_same(tmp_path):
    layout = Layout(dp=2, ep=2, micro_batch_size=2, microbatches=2)
    whole = train(RunConfig(model=DSMOE, layout=layout, steps=4, progress=False))
    train(RunConfig(model=DSMOE, layout=layout, steps=2, save=str(tmp_path), progress=False))
    resumed = train(RunConfig(model=DSMOE, layout=layout, steps=4, resume=str(tmp_path), progress=False))
    assert resumed.losses == whole.losses[2:]
    assert resumed.moe_steps()[-1][0]["bias"] == whole.moe_steps()[-1][0]["bias"]
    assert any(b != 0 for b in whole.moe_steps()[1][0]["bias"])
    # and onto another layout: the bias resharded (replicated everywhere) continues the same
    other = train(RunConfig(model=DSMOE, layout=Layout(dp=2, micro_batch_size=2, microbatches=2, zero=3), steps=4,
                            resume=str(tmp_path), progress=False))
    assert other.moe_steps()[0][0]["bias"] is not None


# -- sabotage ---------------------------------------------------------------------------------------
def _on_ranks(fn, real):
    """`fn` on the simulated ranks' threads (the layout), `real` in the check's reference."""
    return lambda *a: fn(*a) if threading.current_thread().name.startswith("sim-rank") else real(*a)


@pytest.mark.sabotage
def test_the_check_catches_a_bias_moved_by_a_ranks_own_counts(monkeypatch):
    """Each rank moves its bias by the assignments it routed itself, not the whole batch's:
    the replicas' biases drift apart."""
    real = MoE.update_bias

    def local(self, *args):
        if self.load is not None:
            self.load = sum(call[2] for call in self.stats.calls if call[2] is not None)
        real(self, *args)
    monkeypatch.setattr(MoE, "update_bias", _on_ranks(local, real))
    rep = check(_run(DSMOE, dp=2, ep=2))
    assert not rep.passed and any("expert_bias" in p and "replicas must be equal" in p for p in rep.problems)


@pytest.mark.sabotage
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_check_catches_shared_experts_reduced_as_experts(dtype, monkeypatch):
    """The shared experts put in the experts' parameter group: their gradient averaged over
    the expert-data-parallel group and divided by ep, as the routed experts' must be."""
    import moe.plan as plan
    real = plan.expert_parameters
    monkeypatch.setattr(plan, "expert_parameters", lambda model: real(model) + [
        p for layer in model.moe_layers() if layer.shared is not None for p in layer.shared.parameters()])
    rep = check(_run(DSMOE, steps=1, dp=2, ep=2, dtype=dtype))
    assert not rep.passed and "shared" in rep.worst("grad").name


@pytest.mark.sabotage
def test_the_check_catches_shared_expert_gradients_not_summed_over_tensor_parallel_slices(monkeypatch):
    import tensor_parallel.plan as plan
    from tensor_parallel.mappings import copy_to_tp
    monkeypatch.setattr(plan, "copy_to_tp", lambda w, group, label: w if "shared" in label else
                        copy_to_tp(w, group, label))
    rep = check(_run(DSMOE, steps=1, dp=2, tp=2, sequence_parallel=True, ep=2))
    assert not rep.passed and "shared" in rep.worst("grad").name


@pytest.mark.sabotage
def test_the_check_catches_a_sequence_loss_counted_on_the_rank_alone(monkeypatch):
    """Under context parallelism each rank holds part of every sequence: counting f_i over
    its part alone is another loss (and other router gradients)."""
    real = MoE.forward

    def alone(self, x):
        self.sequence_group = None
        return real(self, x)
    monkeypatch.setattr(MoE, "forward", alone)
    rep = check(_run(DSMOE.with_(aux_loss_coef=0.1), steps=1, cp=2, ep=2))
    assert not rep.passed and "router" in rep.worst("grad").name


def test_record_keeps_the_selection_scores():
    """The check's replay compares what the choice ranked: scores plus bias."""
    layer = MoE(BASE.with_(bias_update_rate=0.1)).double()
    torch.nn.init.normal_(layer.router.weight, std=0.3)
    layer.expert_bias = torch.tensor([0.0, 0.5, 0.0, -0.5], dtype=torch.float64)
    layer.record, layer.stats = True, MoEStats()
    x = torch.randn(1, 8, BASE.d_model, dtype=torch.float64)
    layer(x)
    kept, _ = layer.stats.decisions[0]
    scores = router_scores(layer.router(x.reshape(8, -1)), layer.config).detach()
    assert torch.equal(kept, scores + layer.expert_bias)
    assert mm.choose(kept, layer.config).same(layer.stats.decisions[0][1])


# -- the shared experts beside the combine (moe/dispatch.py) ----------------------------------------
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_the_shared_experts_hide_part_of_the_combine(capacity_factor, monkeypatch):
    """Run while the combine is in flight, forward and backward, the shared experts' compute
    leaves less of it exposed in a plan than the same layer running them after it."""
    import moe.dispatch as d
    from benchmarks.moe_overlap import after_the_combine
    from playground.planning import plan
    run = RunConfig(model=DSMOE.with_(capacity_factor=capacity_factor), layout=Layout(ep=2, dp=2, micro_batch_size=2),
                    dtype="bfloat16", bf16_copies=True, hardware="h200", progress=False)
    beside = plan(run).values[0]["step"]
    monkeypatch.setattr(d, "all_to_all_during", after_the_combine)
    after = plan(run).values[0]["step"]
    assert beside["compute"] == pytest.approx(after["compute"])
    assert beside["exposed_comm"] < 0.85 * after["exposed_comm"]


def test_the_shared_experts_backward_runs_while_the_combines_reverse_is_in_flight(monkeypatch):
    """Autograd runs the latest-made node first: the shared experts' nodes, made between the
    combine's issue and its wait, run after the reverse all-to-all is issued (`_Wait`'s
    backward) and before it is waited (`_Start`'s)."""
    import moe.dispatch as d
    events: dict = {}

    def logged(fn, what):
        def run(ctx, *grads):
            events.setdefault(threading.get_ident(), []).append(what)
            return fn(ctx, *grads)
        return staticmethod(run)
    monkeypatch.setattr(d._Wait, "backward", logged(d._Wait.backward, "issued"))
    monkeypatch.setattr(d._Start, "backward", logged(d._Start.backward, "waited"))
    real = MoE._shared_of

    def shared_of(self, x):
        def shared():
            y = real(self, x)()
            y.register_hook(lambda g: events.setdefault(threading.get_ident(), []).append("shared"))
            return y
        return shared
    monkeypatch.setattr(MoE, "_shared_of", shared_of)
    train(RunConfig(model=DSMOE.with_(n_layers=1), layout=Layout(dp=2, ep=2), steps=1, progress=False))
    assert sorted(events.values()) == [["issued", "shared", "waited"]] * 2


@pytest.mark.sabotage
def test_the_check_catches_a_combine_whose_backward_is_not_exchanged(monkeypatch):
    """The combine's backward hands its gradient on as it arrived, without the reverse
    all-to-all (even shapes at a capacity: no error, wrong expert gradients)."""
    import moe.dispatch as d
    real = d._Start.backward

    def unexchanged(ctx, grad):
        real(ctx, grad)  # (the reverse all-to-all still issued and waited: only its result dropped)
        return (grad,) + (None,) * 5
    monkeypatch.setattr(d._Start, "backward", staticmethod(unexchanged))
    rep = check(_run(OPTIONS["shared-fine"], steps=1, dp=2, ep=2))
    assert not rep.passed and "experts" in rep.worst("grad").name


@pytest.mark.slow
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_the_combine_in_flight_gives_gloo_the_simulated_losses(capacity_factor):
    """The asynchronous combine on torch.distributed (gloo processes) as on simulated ranks:
    the same losses, bit for bit."""
    run = RunConfig(model=DSMOE.with_(capacity_factor=capacity_factor), layout=Layout(dp=2, ep=2), steps=3,
                    dtype="float64", progress=False)
    sim = train(run)
    gloo = train(RunConfig(**{**run.__dict__, "backend": "gloo"}))
    assert gloo.losses == sim.losses
