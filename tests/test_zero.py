"""ZeRO-1/2/3: equivalence with one device for every stage, the bytes each
stage moves per step, the model-state memory of the paper's formulas, mixed precision and
dynamic loss scaling."""
import contextlib
import math

import pytest
import torch

from collectives import Mesh, launch
from simulator.memory import MemoryTracker
from model import GPT, preset
from playground import Layout, RunConfig
from playground.equivalence import check
from playground.data_parallel import zero_units
from playground.training import train
from zero import DynamicLossScaler, ZeroDataParallel
from zero.zero import unit_specs

# unit sizes 5500 (root) and 15884 (blocks): not divisible by 3 or 8, so shards are uneven
CFG = preset("tiny", vocab_size=62, d_model=44, n_heads=2, d_ff=61, n_layers=2)


def _run(stage, dp, dtype="float64", microbatches=2, steps=3, **kw):
    return RunConfig(model=CFG, layout=Layout(dp=dp, zero=stage, microbatches=microbatches, micro_batch_size=2),
                     steps=steps, dtype=dtype, progress=False, **kw)


def _specs(model):
    """The units training gives the engine (playground.data_parallel.zero_units)."""
    return unit_specs(model, zero_units(model))


def test_the_test_model_has_uneven_shards():
    sizes = [sum(p.numel() for _, p in ps) for _, _, ps in _specs(GPT(CFG))]
    for dp in (3, 8):
        assert any(s % dp for s in sizes)


def _stage_cases():
    """(stage, dp, dtype): the default tier holds float64 at dp 1 and 2 and float32 (its
    looser tolerance) at dp 3, the uneven shards; the slow tier the others, with dp 4 and 8."""
    for stage in (1, 2, 3):
        for dtype in ("float64", "float32"):
            for dp in (1, 2, 3, 4, 8):
                slow = dp in (4, 8) or (dtype == "float32") != (dp == 3)
                yield pytest.param(stage, dp, dtype, marks=pytest.mark.slow) if slow else (stage, dp, dtype)


@pytest.mark.parametrize("stage,dp,dtype", list(_stage_cases()))
def test_every_stage_matches_one_device(stage, dp, dtype):
    """Loss of every step, every gradient after the first backward and every weight after
    three AdamW steps, with two microbatches of gradient accumulation."""
    rep = check(_run(stage, dp, dtype))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
    assert len([r for r in rep.rows if r.what == "grad"]) == len(list(GPT(CFG).parameters()))


def test_stage_0_and_bfloat16_mixed_precision_match_one_device():
    assert check(_run(0, 3, "float64")).passed
    rep = check(_run(3, 2, "bfloat16"))
    assert rep.passed, [r for r in rep.rows if not r.ok]


@pytest.mark.sabotage
def test_the_check_catches_an_optimizer_that_differs_only_where_gradients_are_tiny(monkeypatch):
    """ZeRO's sharded AdamW with eps 1e-6 instead of 1e-8: the gradients are right and the
    update differs only in elements whose gradient is near eps; each weight element is judged
    against AdamW's own bound, so the check still fails."""
    import zero.zero
    real = zero.zero.adamw
    monkeypatch.setattr(zero.zero, "adamw", lambda params, **kw: real(params, **{**kw, "eps": 1e-6}))
    rep = check(_run(1, 2, microbatches=1, steps=2))
    assert not rep.passed and rep.worst("grad").ok and not rep.worst("weight").ok


@pytest.mark.sabotage
def test_the_check_catches_a_zero_that_sums_instead_of_averaging(monkeypatch):
    import types

    import zero.zero
    from collectives import ReduceOp
    monkeypatch.setattr(zero.zero, "ReduceOp", types.SimpleNamespace(AVG=ReduceOp.SUM))
    rep = check(_run(2, 2, microbatches=1, steps=1))
    assert not rep.passed and rep.worst("grad").max_rel > 0.5


def _padded(stage, n):
    return sum(-(-sum(p.numel() for _, p in ps) // n) * n for _, _, ps in _specs(GPT(CFG)))


@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_step_follow_the_paper(stage, dp):
    """Per rank per step (ring): stages 0-2 move 2Ψ·(n-1)/n elements, stage 3 3Ψ·(n-1)/n,
    with Ψ the parameter count (padded to a multiple of n per unit)."""
    steps = 2
    res = train(_run(stage, dp, "float32", microbatches=1, steps=steps))
    psi = sum(p.numel() for p in GPT(CFG).parameters())
    psi_padded = _padded(stage, dp)
    factor = 3 if stage == 3 else 2
    for r in range(dp):
        # stage 0 is DDP: its one-time broadcast of the initial weights is setup, not per step
        sent = sum(e.bytes_sent for e in res.ledger.for_rank(r) if not e.label.startswith(("metrics.", "faults."))
                   and e.op != "broadcast")
        if stage == 0:  # DDP's unpadded ring all-reduce: chunks of Ψ/n rounded per bucket
            assert sent == pytest.approx(factor * psi * (dp - 1) / dp * 4 * steps, rel=1e-4)
        else:
            assert sent == factor * psi_padded * (dp - 1) // dp * 4 * steps
        # the paper's count, within the padding (< n elements per unit)
        assert abs(sent / (steps * 4) - factor * psi * (dp - 1) / dp) <= factor * 3 * dp
    ops = {e.op for e in res.ledger.for_rank(0) if not e.label.startswith(("metrics.", "faults.")) and e.op != "broadcast"}
    assert ops == ({"all_reduce"} if stage == 0 else {"reduce_scatter", "all_gather"})


CFG4 = preset("tiny", vocab_size=62, d_model=44, n_heads=2, d_ff=61, n_layers=4)


def _states(world, stage):
    memory = world.instruments.memory = MemoryTracker()  # the rank's, which the engine reports to
    model = GPT(CFG4, seed=0, dtype=torch.float32)
    z = ZeroDataParallel(model, Mesh(world, dp=world.size).group("dp"), stage, units=list(model.blocks.values()),
                         compute_dtype=torch.bfloat16)
    x = torch.randint(0, CFG4.vocab_size, (2, CFG4.seq_len + 1))
    z(x[:, :-1], x[:, 1:]).backward()
    z.step()
    held = MemoryTracker.measure(z.state_tensors())  # after the step
    report = memory.snapshot(states=held)
    states = {k: report[k] for k in ("parameters", "gradients", "optimizer")}
    return states, held["gradients"], memory.step_gradients, memory.peak_comm_buffers, [u.padded for u in z.units]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_memory_is_the_papers_formula(stage):
    """Mixed-precision AdamW, 2 + 2 + 12 bytes per parameter: stage 0 16Ψ; 1 4Ψ + 12Ψ/N;
    2 2Ψ + 14Ψ/N (Ψ padded per unit; plus AdamW's step counter, 4 bytes per unit); stage 3
    14Ψ/N, the paper's 16Ψ/N less the bf16 parameter partition, which this engine does not
    keep (each all-gather casts the master shard, as FSDP2 does). Measured from the tensors
    each rank holds after a step, with the gradients of stages 2-3 as the step's backward made
    them: they are freed by the optimizer step (nothing is held after it) and made again by
    the next backward."""
    n = 4
    res = launch(_states, n, args=(stage,))
    psi = sum(p.numel() for p in GPT(CFG4).parameters())
    for states, grads_held, grads_alive, peak_buffers, padded in res.values:
        full = sum(padded) if stage else psi
        shard = sum(padded) // n if stage else psi
        units = len(padded)
        params = 0 if stage == 3 else 2 * full
        grads = 2 * (shard if stage >= 2 else full)
        optim = 12 * shard + 4 * units
        assert states == {"parameters": params, "gradients": grads, "optimizer": optim}
        assert grads_alive == 0 and grads_held == (0 if stage >= 2 else grads)
        paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 14 * psi / n}[stage]
        assert sum(states.values()) == pytest.approx(paper, rel=1e-3)
        if stage == 3:  # the in-flight units (at least the largest one, at most root + two blocks) and
            unit_bytes = sorted(2 * p for p in padded)  # the casts of their shards that feed the all-gathers
            assert max(unit_bytes) <= peak_buffers <= (1 + 1 / n) * 2 * (unit_bytes[0] + 2 * unit_bytes[-1])
        elif stage == 2:  # the full gradient of the units in flight: the root's and at most two blocks'
            root, blocks = 2 * padded[0], [2 * p for p in padded[1:]]
            assert max(blocks) <= peak_buffers <= root + 2 * max(blocks) < 2 * sum(padded)
        else:
            assert peak_buffers == 0


def test_train_reports_zero_memory_and_bytes():
    res = train(_run(3, 4, "float32", microbatches=1, steps=2, hardware="h100-sxm"))
    m = res.values[0]["memory"]
    assert m["peak_comm_buffers"] > 0 and m["peak_total"] > m["parameters"] + m["gradients"] + m["optimizer"]
    assert res.values[0]["sim_steps"][-1]["time"] > 0


def test_loss_scaler_skips_overflowing_steps_and_recovers():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    s.update(True)
    assert s.scale == 4.0 and s.skipped == 1
    s.update(False), s.update(False)
    assert s.scale == 8.0


def _fp16(world, init_scale):
    model = GPT(CFG, seed=0, dtype=torch.float32)
    z = ZeroDataParallel(model, world, 2, units=list(model.blocks.values()), lr=3e-3, compute_dtype=torch.float16,
                         loss_scaler=DynamicLossScaler(init_scale=init_scale))
    x = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=torch.Generator().manual_seed(0))
    mine = x[2 * world.rank:2 * world.rank + 2]
    losses, taken = [], []
    for _ in range(16):
        loss = z(mine[:, :-1], mine[:, 1:])
        z.scale_loss(loss).backward()
        taken.append(z.step())
        losses.append(loss.item())
    return losses, taken, z.scaler.scale


@pytest.mark.parametrize("axes", [dict(dp=2, tp=2), pytest.param(dict(cp=2, tp=2, zero=1), marks=pytest.mark.slow)],
                         ids=["dp2-tp2", "cp2-tp2-zero1"])
def test_an_fp16_overflow_in_one_tensor_parallel_slice_skips_the_step_everywhere(axes, monkeypatch):
    """An overflow in the gradient of one tensor-parallel rank's slice (a weight gradient sums
    over every token, so one slice can overflow alone): every rank skips the step and halves
    its scale, so the replicated weights (the norms) stay equal and the check passes. Agreed
    over the ZeRO group alone, that slice's data-parallel ranks skipped while the others
    stepped: the replicas parted and the loss scales disagreed."""
    import threading

    import zero.loss_scaler as ls
    real, calls = ls.DynamicLossScaler.found_overflow, {}

    def one_slice_overflows(self, grads, groups, label, device=None):
        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1
        if name == "sim-rank-0" and calls[name] % 3 == 2:  # the second step of each run: rank 0's slice only
            grads[0].view(-1)[0] = float("inf")
        return real(self, grads, groups, label, device)
    monkeypatch.setattr(ls.DynamicLossScaler, "found_overflow", one_slice_overflows)
    run = RunConfig(model=preset("tiny", vocab_size=61), layout=Layout(micro_batch_size=2, **axes), steps=3,
                    dtype="float16", progress=False)
    rep = check(run)
    assert rep.passed, rep.problems[:2]
    scales = {tuple(s["loss_scale"] for s in v["steps"]) for v in rep.result.values}
    skipped = {tuple(s["skipped"] for s in v["steps"]) for v in rep.result.values}
    assert len(scales) == 1 and skipped == {(False, True, False)}, (scales, skipped)


def test_float16_with_dynamic_loss_scaling_skips_overflows_then_trains():
    losses, taken, scale = launch(_fp16, 2, args=(2.0 ** 20,)).values[0]
    assert taken[0] is False  # 2^20 overflows fp16: skipped, and the scale halves until it fits
    assert scale < 2.0 ** 20 and taken[-1] is True
    first = taken.index(True)
    assert losses[first] == pytest.approx(losses[0])  # skipped steps changed nothing
    assert losses[-1] < losses[first] - 0.1
    assert math.isfinite(losses[-1])


def test_gradients_reduced_in_float32_under_bfloat16_compute():
    run = _run(2, 2, "bfloat16", microbatches=1, steps=2, reduce_dtype="float32")
    rep = check(run)
    assert rep.passed, [r for r in rep.rows if not r.ok]
    res = train(run)
    grads = [e for e in res.ledger.for_rank(0) if e.label.startswith("zero.grads")]
    params = [e for e in res.ledger.for_rank(0) if e.label.startswith("zero.params")]
    assert {e.dtype for e in grads} == {"float32"} and {e.dtype for e in params} == {"bfloat16"}
    with pytest.raises(ValueError, match="--reduce-dtype float32 applies to ZeRO"):
        _run(0, 2, "bfloat16", reduce_dtype="float32")


def _accumulated(world, stage, grad_dtype, microbatches):
    """A float32 linear layer under ZeRO with bf16 compute copies: its gradients summed over
    `microbatches` microbatches (no_sync until the last), and each microbatch's own bf16
    gradient as a plain bf16 copy of the layer computes it."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    plain = torch.nn.Linear(64, 48).to(torch.bfloat16)
    plain.load_state_dict(layer.state_dict())
    z = ZeroDataParallel(layer, world, stage, compute_dtype=torch.bfloat16, grad_dtype=grad_dtype)
    gen = torch.Generator().manual_seed(2)
    each = []
    for k in range(microbatches):
        x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
        with (contextlib.nullcontext() if k == microbatches - 1 else z.no_sync()):
            z(x).float().pow(2).mean().backward()
        plain.zero_grad()
        plain(x).float().pow(2).mean().backward()
        each.append({n: p.grad.double() for n, p in plain.named_parameters()})
    exact = {n: sum(e[n] for e in each) for n in each[0]}
    return [(pl, t, pl.local(exact[pl.name])) for pl, t in z.pieces("grad")]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_accumulated_in_float32_keep_the_sum_of_many_microbatches(stage):
    """grad_dtype float32 (Megatron-LM's main grads): the sum of 32 microbatches' bf16
    gradients is exact to float32 rounding; accumulated in bf16 it is off by bf16's (the
    same test on the default: it must fail there, or it proves nothing)."""
    def worst(grad_dtype):
        out = launch(_accumulated, 1, args=(stage, grad_dtype, 32)).values[0]
        return max(float((t - want).abs().max() / want.abs().max()) for _, t, want in out)
    assert worst(torch.float32) < 1e-6
    assert worst(None) > 1e-4


def test_float32_gradients_pass_the_check_and_are_counted_and_reduced_as_such():
    """bf16 ZeRO-1/2/3 over 3 ranks with --grad-dtype float32 against one device; the
    gradients are held (ZeRO-1: in full) in 4 bytes an element and reduced in float32."""
    for stage in (1, 2, 3):
        rep = check(_run(stage, 3, "bfloat16", microbatches=2, steps=2, grad_dtype="float32"))
        assert rep.passed, (stage, [r for r in rep.rows if not r.ok])
    bf16, fp32 = (train(_run(1, 2, "bfloat16", microbatches=1, steps=1, grad_dtype=g, hardware="h100-sxm"))
                  for g in (None, "float32"))
    assert fp32.values[0]["memory"]["gradients"] == 2 * bf16.values[0]["memory"]["gradients"]
    grads = [e for e in fp32.ledger.for_rank(0) if e.label.startswith("zero.grads")]
    assert grads and {e.dtype for e in grads} == {"float32"}


def test_float32_gradients_need_compute_copies():
    with pytest.raises(ValueError, match="--grad-dtype float32 with --autocast: .* float32 already"):
        RunConfig(model=CFG, layout=Layout(dp=2), dtype="bfloat16", bf16_copies=False, grad_dtype="float32")
    with pytest.raises(ValueError, match="--dtype float32 the gradients are float32 already"):
        RunConfig(model=CFG, layout=Layout(dp=2, zero=1), dtype="float32", grad_dtype="float32")
    with pytest.raises(ValueError, match="grad_dtype='bfloat16'"):
        RunConfig(model=CFG, layout=Layout(dp=2, zero=1), dtype="bfloat16", grad_dtype="bfloat16")
    RunConfig(model=CFG, layout=Layout(dp=2), dtype="bfloat16", grad_dtype="float32")  # (compute copies: the default)


def _new_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _mlp(world, stage, init):
    model = _new_mlp()  # the structure; every rank then loads the same weights (the global RNG is shared by threads)
    model.load_state_dict(init)
    z = ZeroDataParallel(model, world, stage, lr=0.1)
    x = torch.randn(4 * world.size, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z(x[4 * world.rank:4 * world.rank + 4]).pow(2).mean().backward()
    z.step()
    return z.pieces("param")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_any_module_is_one_unit(stage):
    """A module without `blocks` is one flat unit (47 parameters over 3 ranks: uneven)."""
    ref = _new_mlp()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    x = torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)  # the defaults of both optimizers agree
    torch.stack([ref(x[4 * r:4 * r + 4]).pow(2).mean() for r in range(3)]).mean().backward()
    opt.step()
    full = dict(ref.named_parameters())
    pieces = [p for rank in launch(_mlp, 3, args=(stage, init)).values for p in rank]
    assert {pl.name for pl, _ in pieces} == set(full)
    for pl, t in pieces:
        torch.testing.assert_close(t, pl.local(full[pl.name].detach()), rtol=1e-12, atol=1e-14)


class _TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(5, 3).double(), torch.nn.Linear(5, 3).double()

    def forward(self, x, use_a: bool):
        return self.b(x) + (self.a(x) if use_a else 0)


def _two_steps(world, stage, init, microbatches):
    """Step 1 uses both branches, step 2 only b (in every microbatch, or in the last one
    only): the rank's reduced gradients after step 2's backward."""
    model = _TwoBranches()
    model.load_state_dict(init)
    z = ZeroDataParallel(model, world, stage, lr=0.1)
    x = torch.randn(4 * world.size, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mine = x[4 * world.rank:4 * world.rank + 4]
    z(mine, True).pow(2).mean().backward()
    z.step()
    for k in range(microbatches):
        last = k == microbatches - 1
        with (contextlib.nullcontext() if last else z.no_sync()):
            z(mine, not last and microbatches > 1 and k == 0).pow(2).mean().backward()
    return z.pieces("grad")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_parameter_without_a_gradient_contributes_zeros_after_one_that_had_one(stage, microbatches):
    """Gradients are copied into the flat buffer the first time in a step, not added to a
    zeroed one: a parameter that gets none in a step (here branch a in step 2, or in its
    second microbatch only) must still read zeros, not the last step's gradient."""
    ref = _TwoBranches()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    x = torch.randn(8, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    torch.stack([ref(x[4 * r:4 * r + 4], True).pow(2).mean() for r in range(2)]).mean().backward()
    opt.step()
    opt.zero_grad()
    for k in range(microbatches):
        use_a = microbatches > 1 and k == 0
        torch.stack([ref(x[4 * r:4 * r + 4], use_a).pow(2).mean() for r in range(2)]).mean().backward()
    full = dict(ref.named_parameters())
    pieces = [p for rank in launch(_two_steps, 2, args=(stage, init, microbatches)).values for p in rank]
    assert {pl.name for pl, _ in pieces} == set(full)
    for pl, t in pieces:
        want = full[pl.name].grad
        want = torch.zeros_like(full[pl.name]) if want is None else want
        torch.testing.assert_close(t, pl.local(want.detach()), rtol=1e-12, atol=1e-14)
    assert any(pl.name.startswith("a.") and t.abs().max() > 0 for pl, t in pieces) == (microbatches > 1)


@pytest.mark.parametrize("stage", [0, 1])
def test_gradients_reduced_after_the_backward(stage):
    """--no-grad-overlap (Megatron-LM's data parallelism of 2021): the same numbers as one
    device (stage 0 here is DDP in one bucket, stage 1 ZeRO-1's units after the backward),
    and in a plan (bf16: the ZeRO engine at stage 0 or 1) the reductions no longer hide
    behind the backward: more exposed communication, a longer step."""
    rep = check(_run(stage, 3, grad_overlap=False))
    assert rep.passed, [r for r in rep.rows if not r.ok]
    from playground.planning import plan
    steps = {}
    for overlap in (True, False):
        run = RunConfig(model=preset("350m", n_layers=4), layout=Layout(dp=2, zero=stage, micro_batch_size=2),
                        dtype="bfloat16", hardware="h100-sxm", progress=False, grad_overlap=overlap)
        steps[overlap] = plan(run).values[0]["step"]
    assert steps[False]["exposed_comm"] > 1.1 * steps[True]["exposed_comm"]  # (the head's is exposed in both)
    assert steps[False]["time"] > steps[True]["time"]
    with pytest.raises(ValueError, match="--no-grad-overlap: ZeRO-2"):
        _run(2, 2, grad_overlap=False)


def test_training_units_gather_the_embedding_and_the_head_only_around_their_use():
    """zero_units: the embedding and the head are units of their own, each gathered only
    around its use, so ZeRO-3's peak of gathered units and gradient buffers is below the
    engine's with one root unit (norm, embedding and head gathered for the whole backward,
    the head's gradient held in the root's buffer); the norm alone is left to the root."""
    def program(world, split):
        memory = world.instruments.memory = MemoryTracker()
        model = GPT(CFG, seed=0, dtype=torch.float32)
        units = zero_units(model) if split else list(model.blocks.values())
        z = ZeroDataParallel(model, Mesh(world, dp=world.size).group("dp"), 3, units=units,
                             compute_dtype=torch.bfloat16)
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
        z(x[:, :-1], x[:, 1:]).backward()
        z.step()
        return memory.peak_comm_buffers, [len(u.params) for u in z.units]
    (split, sizes), (root, _) = (launch(program, 2, args=(s,)).values[0] for s in (True, False))
    assert sizes[:2] == [1, 1] and sizes[-1] == 1  # the norm; the embedding; ...; the head
    assert split < 0.9 * root  # (measured 0.84 here: the blocks dominate this tiny model)
