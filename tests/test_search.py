"""`playground plan --search`: the candidates are the layouts the world and batch allow, the
memory pre-filter never rejects what would fit (a lower bound of the planned states), and
the layouts that fit come out fastest first, each equal to planning it alone, and the
estimates that screen them equal full plans."""
import json
from dataclasses import replace

import pytest

from model import preset
from playground import Layout, RunConfig
from pipeline.schedules import fewest_microbatches
from playground.planning import plan
from playground.search import candidates, estimate, model_states_bound, points, search

CFG = preset("tiny", n_layers=4)


def test_candidates_fill_the_world_and_the_batch():
    got = candidates(CFG, 8, 16, gpus_per_node=4)
    assert got and len(set(got)) == len(got)
    for layout in got:
        assert layout.world == 8 and layout.global_batch == 16 and layout.tp <= 4
        assert layout.zero in (1, 3) and (layout.pp == 1 or layout.zero == 1)
        assert layout.sequence_parallel == (layout.tp > 1)
    assert {lay.ac for lay in got} == {"none", "selective", "full"}
    assert any(lay.schedule == "interleaved" for lay in got)
    fixed = candidates(CFG, 8, 16, gpus_per_node=8, fixed={"tp": 2, "pp": 2})
    assert fixed and all(lay.tp == 2 and lay.pp == 2 for lay in fixed)


@pytest.mark.parametrize("axes", [dict(dp=4, zero=1), dict(dp=2, tp=2, zero=3, sequence_parallel=True),
                                  dict(dp=2, pp=2, zero=1, microbatches=2)])
def test_the_memory_bound_is_below_the_planned_model_states(axes):
    layout = Layout(micro_batch_size=1, **axes)
    p = plan(RunConfig(model=CFG, layout=layout, dtype="bfloat16", hardware="h100-sxm", progress=False))
    states = max(v["memory"]["parameters"] + v["memory"]["gradients"] + v["memory"]["optimizer"] for v in p.values)
    assert model_states_bound(CFG, layout) <= states <= 1.5 * model_states_bound(CFG, layout)


@pytest.mark.parametrize("axes", [dict(dp=4, zero=1),
                                  pytest.param(dict(dp=4, zero=3, microbatches=2, ac="selective"), marks=pytest.mark.slow),
                                  dict(dp=4, tp=2, zero=3, sequence_parallel=True, dp_replicate=2),
                                  pytest.param(dict(dp=2, pp=2, zero=1, microbatches=3, ac="full"), marks=pytest.mark.slow),
                                  dict(pp=2, zero=1, schedule="interleaved", virtual_stages=2, microbatches=4)])
def test_the_peak_bound_from_one_block_is_below_the_planned_peak(axes):
    """Before a layout is estimated its peak is bounded by the states held all through a
    step and one microbatch's activations in its blocks, one block's of which
    `block_compute` measures: never above the plan's peak, and not far below where
    activations dominate (under full recomputation the peak also holds the activations of
    the block being recomputed, which the bound leaves out: a looser bound, still below)."""
    from playground.search import block_compute, memory_lower_bound
    cfg = preset("tiny", n_layers=4, seq_len=256)
    layout = Layout(micro_batch_size=2, **axes)
    run = RunConfig(model=cfg, layout=layout, dtype="bfloat16", hardware="h100-sxm", progress=False)
    block = block_compute(run, layout.tp, layout.cp, layout.micro_batch_size, layout.ac)
    assert block[2] > 0
    peak = max(v["memory"]["peak_total"] for v in plan(run).values)
    bound = memory_lower_bound(cfg, layout, block)
    assert (0.2 if layout.ac == "full" else 0.3) * peak < bound <= peak, (bound, peak)


@pytest.mark.parametrize("axes", [dict(dp=8, zero=1, microbatches=2), dict(dp=8, zero=3, microbatches=2),
                                  dict(dp=4, tp=2, zero=3, sequence_parallel=True, dp_replicate=2),
                                  dict(dp=8, pp=2, zero=1, microbatches=4)])
def test_the_data_parallel_calls_the_bound_counts_are_at_most_the_run_s(axes):
    """`communication_bound` prices the data-parallel calls a step makes at least
    (`data_parallel_calls`): their bytes never exceed those the planned run's ledger
    counts for each kind of ZeRO call, on a world spanning two nodes of 8."""
    from playground.search import data_parallel_calls
    layout = Layout(micro_batch_size=1, **axes)
    run = RunConfig(model=CFG, layout=layout, dtype="bfloat16", hardware="h100-sxm", progress=False)
    counted: dict = {}
    for op, size, ranks, calls in data_parallel_calls(run, layout):
        counted[op] = counted.get(op, 0) + size * calls
    assert counted

    def made(layout) -> dict:
        out: dict = {}
        for call in plan(replace(run, layout=layout)).ledger.for_rank(0):
            if call.label.startswith("zero.") and call.op in counted:
                out[call.op] = out.get(call.op, 0) + call.size
        return out
    # a plan's first step runs the fewest microbatches the schedule allows, the second all
    first = replace(layout, microbatches=fewest_microbatches(layout.schedule, layout.pp) if layout.pp > 1 else 1)
    both, once = made(layout), made(first)
    made = {op: both[op] - once[op] / 2 for op in both}
    for op, size in counted.items():
        assert 0.5 * made[op] < size <= made[op], (op, size, made[op])


@pytest.mark.slow
def test_search_ranks_what_fits_and_says_why_the_rest_did_not(tmp_path):
    small_hbm = dict(name="tiny-hbm", peak_bf16_flops=989e12, matmul_fraction=0.8, hbm_bandwidth=3.35e12,
                     hbm_fraction=0.9, hbm_capacity=400_000, nvlink_bandwidth=450e9, network_bandwidth=50e9,
                     nvlink_latency=2e-6, network_latency=5e-6, gpus_per_node=8, fp32_flops=67e12,
                     attention_fraction=0.6, kernel_floor=5e-6)
    hw = tmp_path / "tiny.json"
    hw.write_text(json.dumps(small_hbm))
    run = RunConfig(model=CFG, dtype="bfloat16", hardware=str(hw), progress=False)
    res = search(run, 4, 4, fixed={"tp": 1, "micro_batch_size": 1}, headroom=0.0)
    kinds = {kind for _, kind, _ in res.rejected}
    assert res.fits and "planned peak exceeds HBM" in kinds and "model states exceed HBM" in kinds
    steps = [e.step_s for e in res.fits]
    assert steps == sorted(steps) and all(e.exact for e in res.fits[:3])
    best = res.fits[0]
    again = plan(RunConfig(model=CFG, layout=best.layout, dtype="bfloat16", hardware=str(hw), progress=False))
    assert again.step_s == pytest.approx(best.step_s, rel=1e-12)
    assert res.considered == len(res.fits) + len(res.rejected)
    # a layout that fits without recomputation is not planned with it
    fits = {e.layout for e in res.fits}
    assert not any(lay.ac != "none" and lay.__class__(**{**lay.to_dict(), "ac": "none"}) in fits for lay in fits)
    assert "dominated" in kinds
    # the allocator's headroom (playground/fits.py): what fits leaves 12% of the HBM free, and
    # layouts that fit the whole of it are rejected, saying so
    kept = search(run, 4, 4, fixed={"tp": 1, "micro_batch_size": 1})
    assert kept.fits and all(e.peak <= 0.88 * 400_000 for e in kept.fits)
    lost = [why for lay, _, why in kept.rejected if lay in fits]
    assert lost and all("usable (88% of" in why for why in lost)


@pytest.mark.parametrize("axes", [dict(dp=2, zero=1, microbatches=8), dict(dp=2, zero=3, micro_batch_size=2, microbatches=4),
                                  dict(pp=2, zero=1, microbatches=8), dict(dp=2, pp=2, zero=1, microbatches=12, ac="full"),
                                  dict(pp=2, virtual_stages=2, schedule="interleaved", zero=1, microbatches=12),
                                  dict(dp=2, tp=2, sequence_parallel=True, zero=1, microbatches=6, ac="selective"),
                                  dict(dp=8, pp=4, zero=1, microbatches=8, micro_batch_size=4, vocab_size=512),
                                  dict(dp=8, pp=4, virtual_stages=2, schedule="interleaved", zero=1, microbatches=16),
                                  dict(dp=2, pp=2, zero=1, microbatches=12, stage_layers=(3, 5)),
                                  dict(pp=2, virtual_stages=2, schedule="interleaved", zero=1, microbatches=12,
                                       stage_layers=(0, 4, 3, 1)),
                                  dict(dp=8, pp=4, zero=1, microbatches=8, micro_batch_size=4, vocab_size=512,
                                       stage_layers=(1, 3, 3, 1))])
@pytest.mark.slow
def test_an_estimate_from_shallow_plans_equals_the_full_plan(axes):
    """Blocks are identical and microbatches repeat: a layout's step and peak, extrapolated
    from plans of 1 and 2 blocks per chunk (2 and 3 under ZeRO-3), two microbatch counts
    and, for a pipeline of 4 stages (each a node of 8 ranks away from the next), 2 and 3
    stages, are its full plan's (from 1 and 2 blocks under ZeRO-3 the peak comes out 9% over).
    With a vocabulary of 512 the last stage's head holds the largest peak at 2 and 3 stages,
    the first stage's microbatches in flight at 4: the peak is extrapolated per stage. Stages
    of uneven blocks are planned at their own blocks, extrapolated in the microbatches only."""
    axes = dict(axes)
    cfg = preset("tiny", n_layers=8, vocab_size=axes.pop("vocab_size", preset("tiny").vocab_size))
    run = RunConfig(model=cfg, layout=Layout(**{"micro_batch_size": 1, **axes}), dtype="bfloat16",
                    hardware="h100-sxm", progress=False)
    ps, _, _ = points(run.layout, cfg.n_layers, 8, uneven=run.layout.stage_layers is not None)
    assert (ps == (2, 3)) == (run.layout.pp == 4 and run.layout.stage_layers is None)
    e, p = estimate(run), plan(run)
    assert not e.exact and e.plans in (2, 4)
    assert e.step_s == pytest.approx(p.step_s, rel=1e-3)
    assert e.peak == pytest.approx(max(v["memory"]["peak_total"] for v in p.values), rel=1e-3)


def test_search_needs_the_world_and_the_batch(cli):
    status, _, err = cli("plan", "--search", "--hardware", "h100-sxm")
    assert status == 2 and "--world N and --global-batch-size B" in err


def _big():
    from model import GPTConfig
    return GPTConfig(vocab_size=32000, d_model=4096, n_layers=4, n_heads=32, seq_len=4096)


@pytest.mark.parametrize("axes", [dict(dp=8, zero=3)] + [pytest.param(a, marks=pytest.mark.slow) for a in (
    dict(dp=4, tp=2, zero=1, sequence_parallel=True, microbatches=2), dict(pp=2, dp=4, zero=1, microbatches=2, ac="full"),
    dict(pp=2, dp=2, tp=2, zero=1, sequence_parallel=True, microbatches=4, schedule="interleaved", virtual_stages=2))])
def test_the_step_lower_bound_is_below_the_estimate_and_not_far_below(axes):
    from playground.search import block_compute, step_lower_bound
    layout = Layout(micro_batch_size=2, **axes)
    run = RunConfig(model=_big(), layout=layout, dtype="bfloat16", hardware="h100-sxm", progress=False)
    block = block_compute(run, layout.tp, layout.cp, layout.micro_batch_size, layout.ac)
    bound, e = step_lower_bound(run, layout, block), estimate(run)
    assert 0.7 * e.step_s < bound <= e.step_s


@pytest.mark.slow
def test_the_pruned_search_finds_the_same_fastest_as_the_full_one():
    """Branch and bound (playground/search.py, `search`): on compute-bound shapes the pruned
    search plans fewer layouts and puts the same fastest three first, with the same steps,
    as the search that estimates every candidate; no estimate falls below its bound."""
    run = RunConfig(model=_big(), dtype="bfloat16", hardware="h100-sxm", progress=False)
    full = search(run, 8, 16, fixed={"micro_batch_size": 2}, prune=False)
    pruned = search(run, 8, 16, fixed={"micro_batch_size": 2})
    assert pruned.pruned > 0 and pruned.estimated < full.estimated
    assert full.bound_violations == 0 and pruned.bound_violations == 0
    assert [(e.layout, e.step_s) for e in pruned.fits[:3]] == [(e.layout, e.step_s) for e in full.fits[:3]]
    assert pruned.considered == len(pruned.fits) + len(pruned.rejected)


@pytest.mark.slow
def test_a_sabotaged_bound_prunes_the_fastest(monkeypatch):
    """The bound must stay below the estimates: one 3× too high without a pipeline prunes
    unplanned the layouts that were the fastest, and the fastest three change."""
    from playground import search as search_module
    run = RunConfig(model=_big(), dtype="bfloat16", hardware="h100-sxm", progress=False)
    full = search(run, 8, 16, fixed={"micro_batch_size": 2}, prune=False)
    true_bound = search_module.step_lower_bound
    monkeypatch.setattr(search_module, "step_lower_bound",
                        lambda r, lay, block, hw=None: true_bound(r, lay, block, hw) * (3.0 if lay.pp == 1 else 1.0))
    bad = search(run, 8, 16, fixed={"micro_batch_size": 2})
    assert [e.layout for e in bad.fits[:3]] != [e.layout for e in full.fits[:3]]


@pytest.mark.slow
def test_a_sabotaged_peak_bound_rejects_what_fits(monkeypatch):
    """The peak bound must stay below the plans' peaks: one 10× too high rejects unplanned
    layouts that fit, and the fastest three change."""
    from playground import search as search_module
    run = RunConfig(model=_big(), dtype="bfloat16", hardware="h100-sxm", progress=False)
    full = search(run, 8, 16, fixed={"micro_batch_size": 2}, prune=False)
    true_bound = search_module.memory_lower_bound
    monkeypatch.setattr(search_module, "memory_lower_bound", lambda c, lay, block: 10.0 * true_bound(c, lay, block))
    bad = search(run, 8, 16, fixed={"micro_batch_size": 2})
    assert "states and activations exceed HBM" in {kind for _, kind, _ in bad.rejected}
    assert [e.layout for e in bad.fits[:3]] != [e.layout for e in full.fits[:3]]
