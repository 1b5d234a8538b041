"""`playground plan`: the real per-rank program on meta tensors. On a layout small enough
to run, the plan equals the simulated step of an actual run (same ops, same calls); a
layout too large for the profile's memory is flagged with its overshoot."""
import json
import subprocess
import sys

import pytest

from model import preset
from playground import Layout, RunConfig, train
from playground.summary import communication
from simulator.hardware import load_hardware
from playground.planning import plan, stand_ins as planning_stand_ins, summary
from playground.planning import uniform_stages as planning_uniform_stages

CFG = preset("small", n_layers=2)


@pytest.mark.parametrize("layout,dtype", [(Layout(dp=2, micro_batch_size=2), "float32"),
                                          (Layout(tp=2, pp=2, microbatches=2, micro_batch_size=2), "float32"),
                                          # (fp16's loss scaler: its overflow all-reduce planned, no step skipped)
                                          (Layout(dp=2, pp=2, zero=1, microbatches=2, micro_batch_size=2), "float16"),
                                          pytest.param(Layout(cp=2, dp=2, zero=3, micro_batch_size=2), "float32",
                                                       marks=pytest.mark.slow)],
                         ids=["dp2", "tp2-pp2", "dp2-pp2-zero1-fp16", "cp2-dp2-zero3"])
def test_the_plan_equals_the_simulated_step_of_a_real_run(layout, dtype):
    # (a profile without contention beside communication: that depends on when a call starts,
    # and a stand-in's calls start as if every member arrived with it; with h100-sxm's the
    # cp2-dp2-zero3 step's compute differs by more than this test's 1e-4, its time stays within 1%)
    run = RunConfig(model=CFG, layout=layout, steps=2, hardware="h100-datasheet", progress=False,
                    count_every_step=True, dtype=dtype)
    real, planned = train(run), plan(run)
    for r in range(layout.world):
        a, b = real.values[r]["sim_steps"][-1], planned.values[r]["step"]
        # (the step within 1%: a stand-in's collectives end as if every member arrived with it, and
        # the host's lead, bounded by the waited calls in flight, follows when they end; fp16's
        # overflow flag, all-reduced over every stage and read on the host, ends every rank's step
        # with the last stage's, which a stand-in does not see: there the slowest rank's step)
        if dtype != "float16":
            assert b["time"] == pytest.approx(a["time"], rel=1e-2)
        assert b["compute"] == pytest.approx(a["compute"], rel=1e-4)
        ma, mb = real.values[r]["memory"], planned.values[r]["memory"]
        for k in ("parameters", "gradients", "optimizer", "peak_comm_buffers"):
            assert ma[k] == mb[k], k
        assert mb["peak_activations"] == pytest.approx(ma["peak_activations"], rel=1e-3)  # (the token ids)
    slowest = max(v["sim_steps"][-1]["time"] for v in real.values)
    assert planned.step_s == pytest.approx(slowest, rel=1e-2)


@pytest.mark.slow
def test_plan_command_flags_what_does_not_fit(tmp_path):
    p = subprocess.run([sys.executable, "-m", "playground", "plan", "--model", "7b", "--micro-batch-size", "1",
                        "--hardware", "h100-sxm", "--json", str(tmp_path / "p.json")], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "OOM by" in p.stdout and "MFU" in p.stdout
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["schema"] == "playground.plan/1" and d["per_rank"][0]["fits"] is False
    states = sum(d["per_rank"][0]["memory"][k] for k in ("parameters", "gradients", "optimizer"))
    assert states == pytest.approx(16 * preset("7b").n_params(), rel=1e-3)  # bf16 copies + fp32 master and moments
    p = subprocess.run([sys.executable, "-m", "playground", "plan", "--model", "tiny"], capture_output=True, text=True)
    assert p.returncode == 2 and "--hardware is required" in p.stderr
    p = subprocess.run([sys.executable, "-m", "playground", "plan", "--model", "tiny", "--hardware", "h100-sxm",
                        "--save", str(tmp_path / "ck")], capture_output=True, text=True)
    assert p.returncode == 2 and "--save is not a flag of plan: it belongs to train" in p.stderr
    assert not (tmp_path / "ck").exists()
    p = subprocess.run([sys.executable, "-m", "playground", "plan", "--model", "tiny", "--pp", "2", "--dp", "2",
                        "--microbatches", "2", "--hardware", "h100-sxm", "--plots", str(tmp_path / "pics"),
                        "--trace", str(tmp_path / "t.json")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in (tmp_path / "pics").iterdir()) == ["bytes.png", "memory.png", "schedule.png",
                                                                    "step.png", "timeline.png"]
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 2}  # the stand-ins of the two stages
    assert any(e.get("name") == "pp.activations" for e in events) and any(e.get("cat") == "compute" for e in events)


@pytest.mark.parametrize("layout", [Layout(dp=4, tp=2, pp=2, microbatches=2, micro_batch_size=1, sequence_parallel=True),
                                    Layout(dp=2, tp=2, cp=2, pp=4, zero=1, microbatches=2, micro_batch_size=1,
                                           sequence_parallel=True),
                                    Layout(dp=2, tp=2, cp=2, zero=3, micro_batch_size=1)],
                         ids=["dp4-tp2-pp2-sp", "dp2-tp2-cp2-pp4-zero1-sp", "dp2-tp2-cp2-zero3"])
@pytest.mark.slow
def test_plan_by_stand_ins_equals_every_rank(layout, tmp_path):
    # without the kernel floor: identical ranks of an every-rank plan may run a small copy more or
    # less (autograd takes over a gradient or copies it depending on the references other rank
    # threads hold at that instant, such as a pipeline send not yet received), which the floor
    # would turn into microseconds that the pipeline carries over to the step
    hw = tmp_path / "no-floor.json"
    hw.write_text(json.dumps({**load_hardware("h100-sxm").to_dict(), "kernel_floor": 0.0}))
    run = RunConfig(model=preset("small", n_layers=4), layout=layout, steps=2, hardware=str(hw), progress=False)
    classes, every = plan(run), plan(run, every_rank=True)
    assert classes.by_classes and not every.by_classes
    assert len(set(planning_stand_ins(layout).values())) == layout.pp
    for r in range(layout.world):
        a, b = every.values[r], classes.values[r]
        for k in ("time", "compute", "exposed_comm", "idle"):  # to 1e-4 of the step: identical ranks of
            # an every-rank plan already differ by a few ns, the order in which their calls meet
            assert b["step"][k] == pytest.approx(a["step"][k], abs=1e-4 * a["step"]["time"]), (r, k)
        # (backward's temporaries include those gradient copies too: their peak, and so the peak
        # total and its split at the peak, may differ by a few gradients: to 5% of the total)
        drop = lambda m: {k: v for k, v in m.items() if k not in ("peak_temporaries", "peak_total", "at_peak")}  # noqa: E731
        assert drop(b["memory"]) == pytest.approx(drop(a["memory"]), rel=1e-4), r
        assert b["memory"]["peak_total"] == pytest.approx(a["memory"]["peak_total"], rel=5e-2), r
        moved = [{(c["label"], c["calls_per_step"], c["bytes_sent_per_step"], c["bytes_received_per_step"])
                  for c in communication(p.ledger, 2) if c["rank"] == r and not c["setup"]}
                 for p in (classes, every)]  # (setup broadcasts differ by position in the chain)
        assert moved[0] == moved[1] and moved[0], r


def test_stages_whose_ranks_sit_differently_across_nodes_are_planned_rank_by_rank():
    # dp3 × tp2 × pp2 on 8-GPU nodes: stage 1 is ranks 6-11, so ranks 6, 7 reach stage 0
    # within a node and ranks 8-11 across nodes; one stand-in would time them all alike.
    assert planning_uniform_stages(Layout(dp=4, tp=2, pp=2), 8)
    assert not planning_uniform_stages(Layout(dp=3, tp=2, pp=2), 8)
    assert not planning_uniform_stages(Layout(dp=2, cp=3, pp=2), 4)  # stage 0 spans nodes 0-1 unevenly
    run = RunConfig(model=CFG, layout=Layout(dp=3, tp=2, pp=2, microbatches=2), steps=2, hardware="h100-sxm",
                    progress=False)
    p = plan(run)
    assert not p.by_classes and "every rank run" in summary(p)
    exposed = {round(v["step"]["exposed_comm"], 9) for v in p.values[:6]}
    assert len(exposed) == 2  # ranks 0, 1 and ranks 2-5 differ: why they cannot share a stand-in


@pytest.mark.parametrize("axes", [dict(dp=2, zero=0), dict(dp=2, zero=3)])
def test_a_plan_leaves_nothing_behind(axes):
    """The gradient hooks DDP and ZeRO put on parameters live where the garbage collector
    cannot see: a strong reference back to the strategy kept every plan's whole simulated
    world alive, and a search planning layout after layout grew by gigabytes."""
    import gc
    from simulator import SimulatedTime

    def alive():
        gc.collect()
        return sum(isinstance(o, SimulatedTime) for o in gc.get_objects())
    before = alive()
    for _ in range(2):
        p = plan(RunConfig(model=preset("tiny"), layout=Layout(**axes), hardware="h100-sxm", progress=False))
        assert p.step_s > 0
        del p
    assert alive() == before


@pytest.mark.slow
def test_a_peak_fits_when_it_leaves_the_allocator_headroom_free():
    """playground/fits.py: 12% of HBM is kept for the caching allocator by default; a peak
    inside HBM but above the rest is 'tight' and does not fit; --memory-headroom moves it."""
    from types import SimpleNamespace

    from playground.fits import fits, verdict
    hw = SimpleNamespace(hbm_capacity=100 * 2**30)
    assert verdict(80 * 2**30, hw) == "fits" and fits(88 * 2**30, hw)
    assert verdict(90 * 2**30, hw) == "tight (over 88%)" and not fits(90 * 2**30, hw)
    assert verdict(101 * 2**30, hw) == "OOM by 1.00 GiB"
    assert verdict(90 * 2**30, hw, headroom=0.05) == "fits"
    p = subprocess.run([sys.executable, "-m", "playground", "plan", "--model", "tiny", "--hardware", "h100-sxm",
                        "--memory-headroom", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--memory-headroom 1: must be a finite number at least 0 and below 1" in p.stderr


@pytest.mark.parametrize("zero", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_stage_sends_its_input_gradient_on_before_its_reduction_ends(zero, tmp_path):
    # Megatron-LM's pipeline schedules wait for the data-parallel reductions after the
    # schedule (finish_grad_sync), not at the end of each chunk's last backward: the last
    # stage's reduction runs beside the first stage's last backward instead of before it.
    # On a slow network (every GPU its own node), the first stage's pipeline bubble is then
    # the same with data parallelism as without it, while the reductions take long.
    hw = tmp_path / "slow-network.json"
    hw.write_text(json.dumps({**load_hardware("h100-sxm").to_dict(), "gpus_per_node": 1, "network_bandwidth": 2e8}))
    plans = [plan(RunConfig(model=preset("small", n_layers=4), dtype="bfloat16",
                            layout=Layout(dp=dp, pp=2, zero=zero, microbatches=4, micro_batch_size=1),
                            hardware=str(hw), progress=False)) for dp in (1, 2)]
    (first, last), (first_dp, last_dp) = ((p.values[0]["step"], p.values[-1]["step"]) for p in plans)
    reduction = last_dp["exposed_comm"] - last["exposed_comm"]
    assert reduction > 2 * first["bubble"] > 0  # (the reductions are what would show)
    assert first_dp["bubble"] == pytest.approx(first["bubble"], rel=0.05)


def test_flashattention_1_is_planned_at_half_the_attention_speed(monkeypatch):
    """attention="flash1" (FlashAttention-1's kernels: Dao 2023 has FlashAttention-2 about 2x
    faster) plans every attention kernel of the step, forward and backward, at half the
    profile's rate and nothing else differently: with a third generation at a quarter, the
    step grows by 1, then 3 times the attention's time at the profile's rate; the memory
    stays that of the flash kernel."""
    from simulator import compute_model
    monkeypatch.setitem(compute_model.FLASH_GENERATIONS, "quarter", 0.25)
    cfg = preset("small", n_layers=2, seq_len=2048, d_model=1024, n_heads=8)
    steps, peaks = {}, {}
    for kernel in ("flash", "flash1", "quarter"):
        model = cfg.with_(attention="flash") if kernel == "quarter" else cfg.with_(attention=kernel)
        run = RunConfig(model=model, layout=Layout(micro_batch_size=2, microbatches=2), hardware="h100-sxm",
                        dtype="bfloat16", progress=False)
        if kernel == "quarter":
            monkeypatch.setitem(compute_model.FLASH_GENERATIONS, "flash", 0.25)
        p = plan(run)
        steps[kernel], peaks[kernel] = p.step_s, p.peak
    half, quarter = steps["flash1"] - steps["flash"], steps["quarter"] - steps["flash"]
    hw = load_hardware("h100-sxm")
    forward = 4 * 2 * 8 * 2048 * 2048 * 128 * 2049 // (2 * 2048)  # QKᵀ and PV of a microbatch, causal
    # (the backward 2.5 times the forward: torch's count takes in its recomputation of QKᵀ)
    attention = 2 * 2 * 3.5 * forward / (hw.peak_bf16_flops * hw.attention_fraction_at(128, 2048))
    assert half == pytest.approx(attention, rel=1e-6) and quarter == pytest.approx(3 * half, rel=1e-6)
    assert peaks["flash1"] == peaks["flash"]


def test_a_host_bound_plan_says_its_step_hangs_on_the_host(cli):
    """A tiny model on an H200 is all host: the plan says so, with its issuing time and the
    profile's kernel floor; a step whose device waits for no host gets no such line."""
    from types import SimpleNamespace

    from playground.planning import host_bound_note
    status, out, err = cli("plan", "--model", "tiny", "--hardware", "h200")
    assert status == 0, err
    line = next(x for x in out.splitlines() if x.startswith("host-bound"))
    floor = load_hardware("h200").kernel_floor
    assert f"at {floor * 1e6:.0f} µs each (h200's kernel_floor" in line and "ms of device compute" in line
    busy = {"time": 0.1, "compute": 0.099, "host": 0.001, "issuing": 0.05}
    waiting = {"time": 0.1, "compute": 0.05, "host": 0.05, "issuing": 0.1}
    p = SimpleNamespace(values=[{"step": busy}, {"step": busy}], run=SimpleNamespace(hardware="h200"))
    assert host_bound_note(p, load_hardware("h200")) == ""
    p.values[1] = {"step": waiting}
    assert host_bound_note(p, load_hardware("h200")).startswith("host-bound (rank 1): the device waits 50.00 ms")


def test_a_bf16_plan_says_which_recipe_it_prices():
    """bf16 is planned as compute copies of fp32 masters, what `train --dtype bfloat16` runs;
    `train --autocast` runs autocast instead, and the plan says it does not price that
    recipe's casts."""
    def header(**kw):
        layout = Layout(**kw)
        return summary(plan(RunConfig(model=preset("tiny"), layout=layout, dtype="bfloat16", hardware="h200",
                                      progress=False)))
    alone = header()
    assert "bf16 compute copies of fp32 masters, as train runs it" in alone
    assert "`train --autocast` runs under torch.autocast instead" in alone
    sharded = header(dp=2, zero=1)
    assert "ZeRO's bf16 compute copies" in sharded and "autocast" not in sharded
    fp32 = summary(plan(RunConfig(model=preset("tiny"), layout=Layout(), dtype="float32", hardware="h200",
                                  progress=False)))
    assert "autocast" not in fp32 and "), float32, on h200" in fp32


def test_a_moe_plan_on_a_profile_without_region_costs_says_its_regions_are_priced_a_floor_a_call(tmp_path):
    """A profile without `region_op_floor` prices each compiled call one kernel floor: a MoE
    plan says so; one on a profile that measured it, and a dense plan, do not."""
    def header(model, hardware):
        return summary(plan(RunConfig(model=preset(model), layout=Layout(), dtype="bfloat16", hardware=hardware,
                                      progress=False)))
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({**load_hardware("h200").to_dict(), "region_op_floor": 8e-6}))
    note = "compiled regions: each call priced one kernel floor"
    assert note in header("tiny-moe", "h200")
    assert note not in header("tiny-moe", str(measured)) and note not in header("tiny", "h200")


@pytest.mark.parametrize("dtype,model_kw,layout_kw", [
    # float32 experts run as a loop over the experts, whose counts a plan has no values of
    ("float32", {}, {}),
    ("float64", {}, {"dp": 2, "ep": 2}),
    # dropless, T·k = 2·2·15 = 60 assignments over 8 experts: the 4 left over go somewhere
    ("bfloat16", {"capacity_factor": 0.0, "seq_len": 15}, {"dp": 2, "ep": 2}),
    ("float32", {"capacity_factor": 0.0, "seq_len": 15}, {}),
    # an expert width of 7 bf16 values (14-byte rows): torch._grouped_mm refuses it, the loop runs
    ("bfloat16", {"expert_d_ff": 7}, {}),
    ("bfloat16", {"expert_d_ff": 7}, {"dp": 2, "ep": 2}),
], ids=["fp32", "fp64-ep2", "dropless-remainder-ep2", "dropless-remainder-fp32", "unaligned-bf16", "unaligned-bf16-ep2"])
def test_moe_plans_at_any_dtype_and_shape(dtype, model_kw, layout_kw):
    """A plan of an MoE layout runs whatever its dtype and shapes (each case here crashed a
    plan before: a loop over the experts read counts a meta tensor has no values of; balanced
    dropless counts dropped the T·k mod E left over, so the dispatch's sizes did not add up;
    grouped GEMMs were priced at widths their kernels refuse), and its peak is what the
    program holds (playground/memory_audit.py)."""
    from playground.memory_audit import audit
    run = RunConfig(model=preset("small-moe", **model_kw), layout=Layout(micro_batch_size=2, **layout_kw), dtype=dtype,
                    hardware="h200", progress=False)
    p = plan(run)
    assert all(v["step"]["time"] > 0 and v["memory"]["peak_total"] > 0 for v in p.values)
    for r in audit(run):
        assert abs(r["missed"]) <= 0.01 * r["tracked"], r


def test_grouped_gemms_apply_only_to_widths_their_kernels_take():
    import torch
    from model.moe import grouped_mm_applies
    x = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    assert grouped_mm_applies(x, torch.empty(2, 32, 64, device="meta"))
    assert not grouped_mm_applies(x, torch.empty(2, 7, 64, device="meta"))
    assert not grouped_mm_applies(x[:, :12], torch.empty(2, 32, 12, device="meta"))
    assert not grouped_mm_applies(x.float(), torch.empty(2, 32, 64, device="meta"))
