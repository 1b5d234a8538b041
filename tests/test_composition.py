"""Strategies composed by `parallelize`: ZeRO with tensor parallelism (FSDP + TP in 2D),
ZeRO-1 with pipelines (Megatron's distributed optimizer), ZeRO-1 with TP × PP; each
against one device in float64, each with a sabotaged variant the check must catch, and
the bytes per rank per step against the closed forms."""
import types

import pytest
import torch

from model import GPT, Placement, preset
from playground import Layout, RunConfig
from playground.equivalence import check
from playground.data_parallel import zero_units
from playground.training import train
from tensor_parallel import parallelize_tensor
from zero.zero import unit_specs

CFG = preset("tiny", vocab_size=61, n_layers=2)  # 61: the vocabulary is padded for tp = 2


def _run(dtype="float64", steps=3, microbatches=2, sp=False, model=CFG, **axes):
    return RunConfig(model=model, layout=Layout(sequence_parallel=sp, microbatches=microbatches, micro_batch_size=2,
                                                **axes), steps=steps, dtype=dtype, progress=False)


COMPOSITIONS = {
    "dp2-tp2-zero1": dict(dp=2, tp=2, zero=1),
    "dp2-tp2-zero2": dict(dp=2, tp=2, zero=2),
    "dp2-tp2-zero3": dict(dp=2, tp=2, zero=3),
    "dp2-tp2-zero3-sp": dict(dp=2, tp=2, zero=3, sp=True),
    "dp3-tp2-zero3": dict(dp=3, tp=2, zero=3),  # uneven shards
    "pp2-dp2-zero1": dict(pp=2, dp=2, zero=1, microbatches=4),
    "pp2-dp2-zero1-zb1": dict(pp=2, dp=2, zero=1, microbatches=4, schedule="zb1"),
    "pp2-dp2-zero1-interleaved": dict(pp=2, dp=2, zero=1, microbatches=4, schedule="interleaved", virtual_stages=2,
                                      model=preset("tiny", vocab_size=61, n_layers=4)),
    "dp2-tp2-pp2-zero1-sp": dict(dp=2, tp=2, pp=2, zero=1, sp=True, microbatches=4),
}


def _assert_passed(rep):
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


# (the default tier: ZeRO-3 with TP, with and without SP, and the pipelines; ZeRO-1 and 2 with TP
# repeat stage 3's axes, as the sabotages below do)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("dp3-tp2-zero3", "dp2-tp2-pp2-zero1-sp",
                                                                                   "dp2-tp2-zero1", "dp2-tp2-zero2")
                                  else n for n in COMPOSITIONS])
def test_composition_matches_one_device(name):
    rep = check(_run(**COMPOSITIONS[name]))
    _assert_passed(rep)
    assert rep.worst("grad").max_rel < 1e-12 and rep.worst("weight").max_rel < 1e-10


@pytest.mark.parametrize("name", ["dp2-tp2-zero3-sp", pytest.param("dp2-tp2-pp2-zero1-sp", marks=pytest.mark.slow)])
def test_composition_in_float32_and_bfloat16(name):
    _assert_passed(check(_run("float32", **COMPOSITIONS[name])))
    _assert_passed(check(_run("bfloat16", **COMPOSITIONS[name])))


# -- sabotage: each composition's own bug class must fail the check -----------------------------
def _flat_range_of_the_full_tensor(monkeypatch):
    """ZeRO cuts its flat range as if the local tensor were the whole reference parameter
    (the TP slice forgotten): a Contract 4 bug that misplaces every sharded value."""
    monkeypatch.setattr(Placement, "then", lambda self, cut: Placement(self.name, self.shape, (cut,)))


def _zero_over_the_tensor_parallel_group(monkeypatch):
    """ZeRO built on the mesh's tp group instead of dp: the classic wrong-axis bug."""
    import playground.data_parallel as par
    from tensor_parallel import ColumnParallelLinear
    real = par.ZeroDataParallel

    def wrong_group(part, group, *a, **k):
        tp = next(m.group for m in part.modules() if isinstance(m, ColumnParallelLinear))
        return real(part, tp, *a, **k)
    monkeypatch.setattr(par, "ZeroDataParallel", wrong_group)


def _sync_at_the_first_backward(monkeypatch):
    """The pipeline reduces each stage's gradients at its first backward of the step, not
    its last: the later microbatches' gradients are never reduced across dp."""
    import pipeline.executor as ex
    real_init = ex.PipelineExecutor.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        first = {}
        for i, act in enumerate(self.actions):
            if act.kind in ("B", "W"):
                first.setdefault(act.chunk, i)
        self.sync_at = first
    monkeypatch.setattr(ex.PipelineExecutor, "__init__", init)


SABOTAGE = {
    "dp2-tp2-zero1": [_flat_range_of_the_full_tensor, _zero_over_the_tensor_parallel_group],
    "dp2-tp2-zero2": [_flat_range_of_the_full_tensor, _zero_over_the_tensor_parallel_group],
    "dp2-tp2-zero3": [_flat_range_of_the_full_tensor, _zero_over_the_tensor_parallel_group],
    "dp3-tp2-zero3": [_flat_range_of_the_full_tensor],
    "pp2-dp2-zero1": [_sync_at_the_first_backward],
    "dp2-tp2-pp2-zero1-sp": [_sync_at_the_first_backward, _flat_range_of_the_full_tensor],
}


@pytest.mark.sabotage
@pytest.mark.parametrize("name,sabotage", [pytest.param(n, s, marks=pytest.mark.slow)
                                            if n in ("dp2-tp2-pp2-zero1-sp", "dp2-tp2-zero1", "dp2-tp2-zero2")
                                            else (n, s) for n, ss in SABOTAGE.items() for s in ss],
                         ids=lambda x: x if isinstance(x, str) else x.__name__.strip("_"))
def test_sabotaged_composition_fails_the_check(name, sabotage, monkeypatch):
    sabotage(monkeypatch)
    rep = check(_run(steps=2, **COMPOSITIONS[name]))
    assert not rep.passed
    assert rep.problems or rep.worst("grad").max_rel > 1e-3 or rep.worst("weight").max_rel > 1e-3


# -- bytes per rank per step ------------------------------------------------------------------------
def _local_units(tp: int, tp_rank: int, dp: int) -> int:
    """Ψ of one TP rank's slice, padded per unit to a multiple of dp (ZeRO's flat units)."""
    model = GPT(CFG, device="meta")
    if tp > 1:
        parallelize_tensor(model, types.SimpleNamespace(size=tp, rank=tp_rank))
    specs = unit_specs(model, zero_units(model))
    return sum(-(-sum(p.numel() for _, p in ps) // dp) * dp for _, _, ps in specs)


@pytest.mark.parametrize("stage,dp,tp", [(s, 2, 2) for s in (1, 2, 3)] + [
    (3, 3, 2) if s == 3 else pytest.param(s, 3, 2, marks=pytest.mark.slow) for s in (1, 2, 3)])  # (dp 3: stage 3 by default)
def test_zero_with_tp_moves_zeros_share_of_the_tp_slice_and_tp_traffic_is_unchanged(stage, dp, tp):
    """Per rank per step (ring, float32, one microbatch): ZeRO moves 2Ψ_t(n−1)/n elements
    at stages 1-2 and 3Ψ_t(n−1)/n at stage 3, Ψ_t the rank's TP slice padded per unit; the
    TP collectives are exactly those of the same layout under DDP."""
    steps = 2
    zero = train(_run("float32", steps=steps, microbatches=1, dp=dp, tp=tp, zero=stage))
    ddp = train(_run("float32", steps=steps, microbatches=1, dp=dp, tp=tp))
    factor = 3 if stage == 3 else 2
    for r in range(dp * tp):
        tp_rank = r % tp
        psi_t = _local_units(tp, tp_rank, dp)
        sent = sum(e.bytes_sent for e in zero.ledger.for_rank(r) if e.label.startswith("zero."))
        assert sent == factor * psi_t * (dp - 1) // dp * 4 * steps

        def tp_calls(res):
            return [(e.label, e.op, e.shape, e.bytes_sent) for e in res.ledger.for_rank(r) if e.label.startswith("tp.")]
        assert tp_calls(zero) == tp_calls(ddp) and tp_calls(zero)


def test_zero1_with_pp_reduces_each_stage_once_per_step():
    """ZeRO-1 under a pipeline: each stage's units are reduce-scattered once per step (at
    its last backward) and all-gathered once after the update, whatever the microbatches:
    2Ψ_s(n−1)/n elements per rank per step, Ψ_s the stage's parameters padded per unit."""
    steps, m, dp = 2, 4, 2
    res = train(_run("float32", steps=steps, microbatches=m, pp=2, dp=dp, zero=1))
    for r in range(4):
        stage = r // dp
        model = GPT(CFG, device="meta")
        from pipeline import prune
        prune(model, (stage, stage + 1), stage == 0, stage == 1)
        psi_s = sum(-(-sum(p.numel() for _, p in ps) // dp) * dp
                    for _, _, ps in unit_specs(model, list(model.blocks.values())))
        entries = [e for e in res.ledger.for_rank(r) if e.label.startswith("zero.")]
        assert sum(e.bytes_sent for e in entries) == 2 * psi_s * (dp - 1) // dp * 4 * steps
        assert {e.label.split(".")[1] for e in entries} == {f"pp{stage}"}
        units = len({e.label for e in entries}) // 2
        assert len([e for e in entries if e.op == "reduce_scatter"]) == units * steps


@pytest.mark.parametrize("zero,schedule,dp", [(2, "1f1b", 2), (3, "1f1b", 3), (3, "zb1", 2), (2, "gpipe", 3)])
def test_zero_2_and_3_with_a_pipeline_compute_what_one_device_computes(zero, schedule, dp):
    """torchtitan's policy under a pipeline (zero/zero.py, `accumulate`): full gradients
    accumulated over the step's microbatches and reduce-scattered once, stage 3's units
    gathered at their first use and kept until the optimizer step."""
    rep = check(_run(steps=2, microbatches=4, pp=2, dp=dp, zero=zero, schedule=schedule))
    assert rep.passed, rep.worst()


def test_zero_2_and_3_with_a_pipeline_move_zero_1s_bytes_and_stage_3_reshards_at_the_step():
    """Per step, every ZeRO stage under a pipeline reduce-scatters each unit's gradient once
    and all-gathers its parameters once: the same bytes as ZeRO-1 × PP; after the step stage 3
    holds no gathered parameters."""
    sent, calls, after = {}, {}, {}
    for zero in (1, 2, 3):
        res = train(_run(dtype="float32", steps=2, microbatches=4, pp=2, dp=2, zero=zero))
        entries = [e for e in res.ledger.per_rank[0] if e.label.startswith("zero.")]
        sent[zero] = sum(e.bytes_sent for e in entries)
        calls[zero] = len([e for e in entries if e.op == "reduce_scatter"])
        m = res.values[0]["memory"]
        after[zero] = m["parameters"]  # (measured after the last step)
    assert sent[1] == sent[2] == sent[3] and calls[1] == calls[2] == calls[3]
    assert after[3] < after[1]  # stage 3 resharded its units at the step


FP16_PIPELINES = {
    "pp2-dp2-zero1": dict(pp=2, dp=2, zero=1, microbatches=4),
    "pp2-zb1": dict(pp=2, schedule="zb1"),
    "pp2-interleaved": dict(pp=2, schedule="interleaved", virtual_stages=2, model=preset("tiny", vocab_size=61,
                                                                                          n_layers=4)),
    "pp2-tp2-sp": dict(pp=2, tp=2, sp=True),
    "pp3-gpipe": dict(pp=3, schedule="gpipe", microbatches=3, model=preset("tiny", vocab_size=61, n_layers=3)),
    "pp2-dp2-zero3": dict(pp=2, dp=2, zero=3),
}


def _overflow_on(monkeypatch, rank: int, step: int) -> None:
    """Plant an inf in `rank`'s gradients at the optimizer's `step` (1-based) of each run."""
    import threading

    import zero.loss_scaler as ls
    real, calls = ls.DynamicLossScaler.found_overflow, {}

    def planted(self, grads, groups, label, device=None):
        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1
        if name == f"sim-rank-{rank}" and calls[name] % 3 == step:
            grads[0].view(-1)[0] = float("inf")
        return real(self, grads, groups, label, device)
    monkeypatch.setattr(ls.DynamicLossScaler, "found_overflow", planted)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("pp3-gpipe", "pp2-dp2-zero3")
                                  else n for n in FP16_PIPELINES])
def test_float16_through_a_pipeline_matches_one_device(name, monkeypatch):
    """fp16 dynamic loss scaling across pipeline stages (Micikevicius et al. 2018): the last
    stage multiplies the loss by the scale, every earlier stage receives gradients scaled
    once, and every engine divides by the one scale its rank's optimizer holds. An overflow
    planted in the last stage's gradients alone (at step 2) is agreed over every stage: every
    rank skips that step and halves its scale, and the check passes."""
    run = _run("float16", **FP16_PIPELINES[name])
    last = run.layout.world - 1  # (rank order: the pipeline's last stage holds the last ranks)
    _overflow_on(monkeypatch, rank=last, step=2)
    rep = check(run)
    _assert_passed(rep)
    scales = {tuple(s["loss_scale"] for s in v["steps"]) for v in rep.result.values}
    skipped = {tuple(s["skipped"] for s in v["steps"]) for v in rep.result.values}
    assert scales == {(2.0 ** 16, 2.0 ** 16, 2.0 ** 15)} and skipped == {(False, True, False)}, (scales, skipped)


@pytest.mark.sabotage
def test_check_catches_a_pipeline_whose_last_stage_does_not_scale_the_loss(monkeypatch):
    """Sabotage: the loss backpropagated unscaled while the engines divide by the scale."""
    from playground.data_parallel import Syncs
    monkeypatch.setattr(Syncs, "scale_loss", lambda self, loss: loss)
    rep = check(_run("float16", pp=2, dp=2, zero=1, microbatches=4))
    assert not rep.passed and any(r.what == "grad" and not r.ok for r in rep.rows)


@pytest.mark.sabotage
def test_check_catches_pipeline_stages_that_decide_an_overflow_apart(monkeypatch):
    """Sabotage: each stage's engine decides an overflow over its own data-parallel group
    (the pipeline before one scaler per rank): with an overflow in the last stage only,
    that stage skips and halves its scale while the first steps."""
    from playground.data_parallel import ShardedOptimizer

    def apart(self, found_inf=None):
        for e in self.engines:
            e.overflow_groups = [e.group]
            e.step(found_inf)
    monkeypatch.setattr(ShardedOptimizer, "step", apart)
    run = _run("float16", pp=2, dp=2, zero=1, microbatches=4)
    _overflow_on(monkeypatch, rank=run.layout.world - 1, step=2)
    rep = check(run)
    assert not rep.passed
