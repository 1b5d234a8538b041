"""`playground calibrate`: the fits recover known constants, and the command writes a
profile that plan accepts (gloo on this machine's CPU)."""
import collections
import dataclasses
import json
import random
import statistics
import subprocess
import sys
import types

import pytest
import torch
import torch.utils._python_dispatch

from model import preset
from playground import Layout, RunConfig
from playground import training
from playground.calibrate import (PROGRAM_ROUNDS, PROGRAM_STEPS, PROGRAM_WARMUP, attention_shapes, coefficients, cost_op,
                                  MeasurementError, fit_alpha_beta, fit_attention, fit_matmuls, gemm_shapes, issued, measure_program, one_layer_step, memory_bound,
                                  narrow, op_class, predicted_by_op, _attention_timing, _one_layer_line, program_floor, program_floors, program_run, region_calls)
from playground.cli import main
from playground.planning import plan
from simulator.cost_model import collective_cost
from simulator.hardware import PROFILES, hardware_from_dict, load_hardware


def test_alpha_beta_fit_recovers_the_link_it_was_made_from():
    base = PROFILES["h200-datasheet"]
    truth = dataclasses.replace(base, nvlink_latency=30e-6, nvlink_bandwidth=300e9)
    points = [(op, s, collective_cost(cost_op(op), s, range(2), truth)[0])
              for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
              for s in (2**10, 2**16, 2**22, 2**28)]
    alpha, bandwidth = fit_alpha_beta(points, 2, base)
    assert alpha == pytest.approx(30e-6, rel=1e-6) and bandwidth == pytest.approx(300e9, rel=1e-6)
    # a ring all_reduce of p ranks: 2(p-1) steps of α and 2(p-1)/p of the message over β
    c_alpha, c_beta = coefficients("all_gather", 1e6, 4, base)
    assert c_alpha == 3 and c_beta == pytest.approx(0.75e6)


class _Products(torch.utils._python_dispatch.TorchDispatchMode):
    """The (m, k, n) of every aten.mm a program runs."""
    def __init__(self):
        super().__init__()
        self.shapes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket is torch.ops.aten.mm:
            self.shapes[(args[0].shape[0], args[0].shape[1], args[1].shape[1])] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 2, "d_ff": 72, "n_layers": 3}])
def test_the_measured_shapes_are_the_products_the_model_runs(overrides):
    """gemm_shapes against the model itself: a forward and backward of the GPT (on meta
    tensors) runs each of its matrix products as often as gemm_shapes says, no fused q/k/v
    or gate/up a step never runs; grouped-query attention's narrower k and v included."""
    cfg = preset("small").with_(vocab_size=300, **overrides)
    micro_batch = 3
    tokens = micro_batch * cfg.seq_len
    program = one_layer_step(cfg, micro_batch, "meta", layers=cfg.n_layers)
    with _Products() as seen:
        program()
    assert seen.shapes == {(m, k, n): c for m, k, n, c in gemm_shapes(cfg, tokens)}


def test_the_measured_shapes_and_classes():
    cfg = preset("1b")
    shapes = gemm_shapes(cfg, 8192)
    assert (8192, cfg.d_model, cfg.vocab_size, 1) in shapes and len({s[:3] for s in shapes}) == len(shapes)
    # a step's products: three (forward, two backward) of every weight the tokens meet, the
    # flops_per_token of the config less attention's QKᵀ and AV; so for a MoE model, whose
    # experts each take an even share of the top-k choices, and with shared experts
    for name in ("1b", "1b-moe", "1b-dsmoe"):
        c = preset(name)
        attention = 3 * c.n_layers * 4 * c.seq_len * c.d_model
        assert sum(2 * m * k * n * per_step for m, k, n, per_step in gemm_shapes(c, 8192)) == \
            8192 * (c.flops_per_token() - attention), name
    assert [op_class(n) for n in ("aten::mm", "addmm", "_to_copy", "aten::copy_",
                                  "_scaled_dot_product_cudnn_attention_backward", "mul")] == \
        ["matmul", "matmul", "copy", "copy", "attention", "elementwise"]
    assert op_class("aten::_grouped_mm") == "matmul"  # (a MoE layer's experts: a GEMM, not memory traffic)


def test_the_matmul_fit_gives_a_step_its_measured_gemm_time():
    """GEMMs timed at uneven rates (the head's faster than the block's, as on an H200) and in
    tiles that waste part of a wave: priced as the compute model prices them, at the fitted
    fraction and in whole tiles, a step's GEMMs (a block's once per layer) take the time they
    were measured at, in bf16 and in float32; one mean over the shapes would not."""
    cfg, hw = preset("1b"), PROFILES["a100-80gb"]  # (108 SMs and cuBLAS's tiles)
    assert hw.sm_count and hw.matmul_tiles
    rng = random.Random(5)
    bf16, fp32 = [], []
    for m, k, n, per_step in gemm_shapes(cfg, 8192):
        flops, eff = 2 * m * k * n, (0.82 if per_step == 1 else rng.uniform(0.6, 0.8))
        bf16.append({"m": m, "k": k, "n": n, "flops": flops, "per_step": per_step,
                     "seconds": flops * hw.wave_quantization(m, n) / (hw.peak_bf16_flops * eff)})
        fp32.append({**bf16[-1], "seconds": flops / (hw.fp32_flops * eff * 0.9)})
    fraction, fp32_flops = fit_matmuls(bf16, fp32, hw)

    def step(rows, priced):
        return sum(r["per_step"] * priced(r) for r in rows)
    assert step(bf16, lambda r: r["flops"] * hw.wave_quantization(r["m"], r["n"]) / (hw.peak_bf16_flops * fraction)) \
        == pytest.approx(step(bf16, lambda r: r["seconds"]), rel=1e-12)
    assert step(fp32, lambda r: r["flops"] / (fp32_flops * fraction)) == \
        pytest.approx(step(fp32, lambda r: r["seconds"]), rel=1e-12)
    once = sum(r["flops"] for r in bf16) / sum(r["seconds"] for r in bf16) / hw.peak_bf16_flops
    assert once > fraction * 1.01  # (the head, weighted as one block, lifts the mean)


def test_the_hbm_rate_is_fitted_on_the_memory_bound_classes_less_compiled_regions():
    """1b-moe's one block as torch's profiler would time it at a known HBM rate: each eager
    memory-bound op's kernels under whichever aten op launched them (an embedding's under
    index_select, the loss gradient's under fill_, the casts under copy_), and its compiled
    MoE region as generated kernels (no aten name) beside the grouped GEMMs they call. The fit
    recovers the rate; the region's GEMMs and the plan's region kernels stay out of it."""
    rate = 2.4e12
    moved, _ = predicted_by_op(preset("1b-moe"), 4, PROFILES["h100-datasheet"])
    fit = memory_bound(moved, {})
    assert fit["regions"] == ["moe_layer", "moe_layer_backward"] and moved["moe_layer"][2] > 0
    eager = {n: b / rate for n, (_, _, b) in moved.items() if op_class(n) == "elementwise" and n not in fit["regions"]}
    profiled = {**eager, "embedding": 0.0, "index_select": eager["embedding"], "nll_loss_backward": 1e-5,
                "fill_": eager["nll_loss_backward"] - 1e-5, "_grouped_mm": 1.4e-3, "mm": 3.4e-3,
                "copy_": sum(b for n, (_, _, b) in moved.items() if op_class(n) == "copy") / rate}
    fit = memory_bound(moved, profiled)
    assert fit["bytes"] / fit["seconds"] == pytest.approx(rate, rel=1e-9)


def test_the_summary_gives_the_profiled_block_by_class_from_its_ops():
    """On CUDA the record keeps the one block's device time by aten op; the summary's line
    sums it by class (`op_class`) beside the plan's."""
    one = {"wall_s": 5e-3, "predicted_s": 4e-3,
           "predicted_by_class_s": {"matmul": 2e-3, "attention": 1e-3, "copy": 2e-4, "elementwise": 8e-4},
           "device_by_op_s": {"mm": 1.5e-3, "addmm": 0.6e-3, "_flash_attention_forward": 0.3e-3,
                              "_flash_attention_backward": 0.6e-3, "copy_": 0.25e-3, "mul": 0.5e-3, "fill_": 0.2e-3}}
    line = _one_layer_line(one)
    assert "predicted/profiled: matmul 2.00/2.10, attention 1.00/0.90, copy 0.20/0.25, elementwise 0.80/0.70" in line
    del one["device_by_op_s"]  # (CPUs: no device profiler)
    assert "ms predicted: matmul 2.00, attention 1.00, copy 0.20, elementwise 0.80" in _one_layer_line(one)
    # attention timed by its kernels on CUDA, the events' wall time at the model's shape beside it
    rec = {"model": {"d_model": 1024, "n_heads": 16, "seq_len": 1024},
           "attention": [{"head_dim": 64, "seq": 512, "fraction": 0.2, "seconds": 1e-3, "wall_s": 4e-3},
                         {"head_dim": 64, "seq": 1024, "fraction": 0.3, "seconds": 1e-3, "wall_s": 2e-3}]}
    assert _attention_timing(rec) == "; its kernels' time under the profiler, 0.150 by CUDA events"
    assert _attention_timing({**rec, "attention": [{k: v for k, v in r.items() if k != "wall_s"}
                                                   for r in rec["attention"]]}) == ""


def test_attention_is_fitted_by_head_dimension_and_sequence():
    """The table recovers each measured shape's rate, which a plan then reads at another
    model's shape; a single point (CPUs) gives the fraction and no table."""
    cfg = preset("1b")  # head dimension 64, 2048 tokens, width 2048
    shapes = attention_shapes(cfg, 4, cuda=True)
    assert (4, 32, 2048, 64) in shapes and {s[3] for s in shapes} == {64, 128} and len(shapes) == 12
    assert all(b * s >= 4 * 2048 and h * d == 2048 for b, h, s, d in shapes)
    assert attention_shapes(cfg, 4, cuda=False) == [(4, 32, 2048, 64)]
    hw = PROFILES["h100-datasheet"]

    def rate(d, s):  # a kernel that gains with the sequence and the head dimension
        return 0.1 * (s / 512) ** 0.3 * (d / 64) ** 0.5
    rows = [{"batch": b, "heads": h, "seq": s, "head_dim": d, "flops": 1e12,
             "seconds": 1e12 / (hw.peak_bf16_flops * rate(d, s))} for b, h, s, d in shapes]
    fraction, table = fit_attention(rows, cfg, hw.peak_bf16_flops)
    assert fraction == pytest.approx(rate(64, 2048))
    fitted = hardware_from_dict(dataclasses.replace(hw, attention_fraction=fraction, attention_table=table).to_dict())
    for b, h, s, d in shapes:
        assert fitted.attention_fraction_at(d, s) == pytest.approx(rate(d, s))
    assert fitted.attention_fraction_at(64, 1024) < 0.85 * fraction  # 350m's shape, not 1b's
    assert fit_attention(rows[2:3], cfg, hw.peak_bf16_flops) == (pytest.approx(rate(64, 2048)), None)


def test_an_attention_shape_without_kernel_time_is_said_not_fitted():
    """A profile that recorded no kernel at a shape would give an infinite rate: the fit
    names the shape and the events' time instead."""
    cfg = preset("1b")
    rows = [{"batch": 4, "heads": 32, "seq": 2048, "head_dim": 64, "flops": 1e12, "seconds": 0.0, "wall_s": 2e-3}]
    with pytest.raises(MeasurementError, match=r"batch 4, heads 32, sequence 2048, head dimension 64: no kernel "
                                               r"time was recorded \(CUDA events timed 2.000 ms\)"):
        fit_attention(rows, cfg, PROFILES["h100-datasheet"].peak_bf16_flops)


@pytest.mark.slow
def test_calibrate_writes_a_profile_that_plan_takes(tmp_path):
    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "playground", "calibrate", "--backend", "gloo", "--world", "2",
                        "--model", "tiny", "--micro-batch-size", "2", "--max-mib", "0.01", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "matmul_fraction" in r.stdout and "nvlink" in r.stdout and "one block + head" in r.stdout
    hw = load_hardware(str(out))
    assert hw.name == "cpu" and "calibrate on 2× cpu" in hw.source and hw.kernel_floor > 0
    assert "collective_floor" in r.stdout and hw.collective_floor > 0  # measured on the 2 ranks
    assert "selective_floor" in r.stdout and hw.selective_floor is not None and hw.selective_floor >= 0
    record = json.loads(out.read_text())["calibration"]
    assert {c["op"] for c in record["collectives"]} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                        "send_recv"}
    # (on a CPU attention is timed at the model's shape alone: a fraction, no table)
    assert [(a["head_dim"], a["seq"]) for a in record["attention"]] == [(8, 32)] and hw.attention_table is None
    p = plan(RunConfig(model=preset("tiny"), layout=Layout(dp=2), hardware=str(out), progress=False))
    assert p.step_s > 0 and p.values[0]["step"]["compute"] > 0
    # the kernel floor makes a plan of the timed program issue its step in the host's time
    program = record["program"]
    assert "a step over" in r.stdout and program["ops"] > 100 and program["calls"] > 0
    # (on a CPU the compiled regions run op by op, at the floor of the rest: nothing timed apart)
    assert "region_op_floor" in r.stdout and program["region_ops"] > 0 and hw.region_op_floor == hw.kernel_floor
    assert "region_host_s" not in program
    # (three runs of the narrow program, their timed steps pooled)
    assert program["rounds"] == 3 and len(program["round_host_s"]) == 3 and "the step's host by run" in r.stdout
    assert len(program["steps_s"]) == 3 * (PROGRAM_STEPS - PROGRAM_WARMUP)
    assert program["host_s"] == statistics.median(program["steps_s"])
    if hw.kernel_floor > record["chain_floor_s"]:
        planned = (program["ops"] + program["region_ops"]) * hw.kernel_floor + program["calls"] * hw.collective_floor
        assert planned == pytest.approx(program["host_s"], rel=1e-9)


def test_calibrate_refuses_what_it_cannot_run(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)

    def run(*args):
        code = main(["calibrate", "--out", str(tmp_path / "x.json"), *args])
        return code, capsys.readouterr().err
    code, err = run("--backend", "torch")
    assert code == 2 and "runs under torchrun" in err
    code, err = run("--backend", "gloo")
    assert code == 2 and "needs --world N" in err
    code, err = run("--backend", "gloo", "--world", "2", "--base", "tpu-v9")
    assert code == 2 and "--base" in err and "tpu-v9" in err
    assert not (tmp_path / "x.json").exists()

    def unfittable(*args):
        raise MeasurementError("attention at batch 4: no kernel time was recorded")
    monkeypatch.setattr("playground.calibrate.calibrate", unfittable)
    code, err = run("--backend", "gloo", "--world", "2")
    assert code == 1 and err == "playground calibrate: attention at batch 4: no kernel time was recorded\n"
    assert not (tmp_path / "x.json").exists()


def test_the_shipped_h200_profile_is_calibrated_and_files_must_be_complete(tmp_path):
    h200 = load_hardware("h200")
    assert "playground calibrate" in h200.source and h200.kernel_floor > 0
    assert load_hardware("h200-datasheet").source.startswith("datasheet")
    partial = {k: v for k, v in PROFILES["h100-datasheet"].to_dict().items() if k != "kernel_floor"}
    (tmp_path / "p.json").write_text(json.dumps(partial))
    with pytest.raises(ValueError, match=r"missing \['kernel_floor'\]"):
        load_hardware(str(tmp_path / "p.json"))


@pytest.mark.parametrize("name", ["small", "tiny-dsmoe"])
def test_the_narrow_program_issues_the_ops_of_the_model_at_its_width(name):
    """The kernel floor is timed on `narrow(cfg)` and charged on `cfg`: the two must issue the
    same ops, ops of compiled regions (the optimizer's master_adamw in both, the MoE layer's)
    and calls (a dense model and one with shared experts and compiled MoE regions)."""
    cfg = preset(name)
    narrow_ops = issued(program_run(cfg, 2, "sim"))
    wide = RunConfig(model=cfg, layout=Layout(dp=2, micro_batch_size=1), dtype="bfloat16", progress=False)
    assert narrow(cfg).d_model == 8 * cfg.n_heads and narrow(cfg).n_layers == cfg.n_layers
    ops, region_ops, calls = narrow_ops
    assert narrow_ops == issued(wide) and ops > 100 and region_ops > 0 and calls > 0


def test_the_program_is_timed_over_fresh_runs_and_their_steps_pooled(monkeypatch):
    # a host at three speeds in three runs: the floor's time is the middle one, each run's kept
    speeds = iter([0.030, 0.050, 0.040])

    def train_rank(world, run):
        t = next(speeds)
        return {"step_times": [9.0] * PROGRAM_WARMUP + [t + 0.001] * (run.steps - PROGRAM_WARMUP),
                "host_blocked": [0.0] * PROGRAM_WARMUP + [0.001] * (run.steps - PROGRAM_WARMUP)}
    monkeypatch.setattr(training, "train_rank", train_rank)
    got = measure_program(types.SimpleNamespace(size=1), preset("tiny"), "sim")
    assert got["host_s"] == pytest.approx(0.040) and got["round_host_s"] == pytest.approx([0.030, 0.050, 0.040])
    assert got["rounds"] == PROGRAM_ROUNDS == 3 and len(got["steps_s"]) == 3 * (PROGRAM_STEPS - PROGRAM_WARMUP)


def test_the_program_floor_puts_the_host_time_on_the_ops_after_the_calls():
    assert program_floor(0.010, 200, 4, 1e-3) == pytest.approx((0.010 - 0.004) / 200)
    assert program_floor(0.010, 200, 0, None) == pytest.approx(0.010 / 200)
    assert program_floor(0.001, 200, 4, 1e-3) == 0.0  # (the calls took all of it: no negative floor)


def test_the_program_floors_put_the_regions_time_on_their_ops_and_the_rest_on_the_others():
    """Timed on CUDA: the regions' host time over their graphs' ops, the rest of the step less
    the calls over the other ops. Elsewhere (regions run op by op): one floor over all ops."""
    program = {"host_s": 0.010, "region_host_s": 0.004, "ops": 200, "region_ops": 400, "calls": 2}
    assert program_floors(program, 1e-3) == (pytest.approx((0.010 - 0.004 - 0.002) / 200), pytest.approx(1e-5))
    untimed = {k: v for k, v in program.items() if k != "region_host_s"}
    assert program_floors(untimed, 1e-3) == (pytest.approx(0.008 / 600), pytest.approx(0.008 / 600))
    assert program_floors({**program, "region_ops": 0}, None)[1] is None


def test_the_region_calls_are_kept_per_region_and_way_past_compilation():
    from model.region_timer import RegionTimer
    timer = RegionTimer()
    timer.calls = [("moe", "forward", 9.0), ("moe", "backward", 5.0), ("moe", "forward", 1.0),
                   ("moe", "backward", 2.0), ("adamw", "forward", 0.5), ("adamw", "forward", 0.25)]
    assert region_calls(timer, 2) == [
        {"region": "adamw", "way": "forward", "calls_per_step": 1.0, "median_s": 0.25},
        {"region": "moe", "way": "backward", "calls_per_step": 1.0, "median_s": 2.0},
        {"region": "moe", "way": "forward", "calls_per_step": 1.0, "median_s": 1.0}]
