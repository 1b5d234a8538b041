"""Faults on purpose: injected crashes, hangs, slow ranks and NaN gradients are found (a
crash at once, a hang by the collective timeout naming who waits for whom, a NaN before the
optimizer step on every rank alike), and a restart from the last checkpoint continues the
same run bit for bit."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from collectives import CollectiveTimeoutError, RankFailedError
from model import preset
from playground import Layout, RunConfig, train
from playground.checkpoint import export
from playground.faults import Fault, InjectedCrash, NonFiniteError, parse_fault

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(layout=None, steps=4, **kw):
    return RunConfig(model=kw.pop("model", preset("tiny")), layout=layout or Layout(dp=2), steps=steps,
                     progress=False, **kw)


# -- the fault's text ---------------------------------------------------------------------------
def test_faults_parse_and_bad_ones_name_the_text():
    assert parse_fault("crash@5:1") == Fault("crash", 5, 1)
    assert parse_fault("crash!@2:0") == Fault("crash", 2, 0, permanent=True)
    assert parse_fault("slow:2.5@3:1") == Fault("slow", 3, 1, factor=2.5)
    assert str(parse_fault("slow:3@2:0")) == "slow:3@2:0" and str(parse_fault("nan@1:0")) == "nan@1:0"
    for bad, message in (("crash", "KIND@STEP:RANK"), ("boom@1:0", "KIND@STEP:RANK"), ("crash@0:1", "counts from 1"),
                         ("slow@2:0", "slow needs a factor"), ("slow:0.5@2:0", "above 1"), ("nan:3@1:0", "KIND")):
        with pytest.raises(ValueError, match=message):
            parse_fault(bad)
    with pytest.raises(ValueError, match=r"rank 4 is not in the world of 2 ranks"):
        _run(faults=(Fault("crash", 1, 4),))
    with pytest.raises(ValueError, match=r"step 9 is after the run's last step \(4, --steps\); it would never fire"):
        _run(steps=4, faults=(Fault("crash", 9, 1),))


# -- detection ----------------------------------------------------------------------------------
def test_a_crash_stops_every_rank_at_once():
    t = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        train(_run(faults=(Fault("crash", 2, 1),)))
    assert isinstance(info.value.__cause__, InjectedCrash) and info.value.rank == 1
    assert time.monotonic() - t < 30


def test_a_hang_is_found_by_the_timeout_naming_who_waits_for_whom():
    before = threading.active_count()
    t = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        train(_run(Layout(dp=3), faults=(Fault("hang", 2, 1),), timeout=1.5))
    took = time.monotonic() - t
    text = str(info.value)
    assert text.startswith("timeout: rank ") and "ranks [1] never arrived" in text
    assert "rank 1: in no call" in text and "rank 0: waits in all_reduce" in text
    assert 1.5 <= took < 30 and threading.active_count() == before  # no rank thread left behind


@pytest.mark.parametrize("layout", [Layout(dp=2), pytest.param(Layout(dp=2, zero=3), marks=pytest.mark.slow),
                                    pytest.param(Layout(pp=2, microbatches=2), marks=pytest.mark.slow)],
                         ids=["ddp", "zero3", "pp"])
def test_a_nan_stops_the_run_on_every_rank_naming_rank_and_tensor(layout):
    with pytest.raises(NonFiniteError, match=r"step 2: a NaN or an Inf in the gradient of .* on rank 1"):
        train(_run(layout, faults=(Fault("nan", 2, 1),)))


@pytest.mark.parametrize("layout", [pytest.param(Layout(dp=2), marks=pytest.mark.slow), Layout(dp=2, zero=3)],
                         ids=["ddp", "zero3"])
def test_a_nan_step_is_skipped_on_every_rank_and_the_replicas_stay_equal(layout, tmp_path):
    """With --on-nan skip the poisoned step changes no weight anywhere: the run equals one whose
    step 2 never happened... and the replicas hold the same weights (the check gathers them)."""
    from playground import check
    rep = check(_run(layout, steps=3, dtype="float64", faults=(Fault("nan", 2, 1),), on_nan="skip"))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
    assert rep.result.values[0]["skipped_steps"] == [2]
    res = train(_run(layout, steps=3, faults=(Fault("nan", 2, 1),), on_nan="skip", save=str(tmp_path / "a")))
    assert res.values[1]["skipped_steps"] == [2]


LAGGED = {"ddp": dict(layout=Layout(dp=2)), "zero3": dict(layout=Layout(dp=2, zero=3)),
          "zero1-bf16-one-pass": dict(layout=Layout(dp=2, zero=1), dtype="bfloat16"),
          "moe-bias-ep2": dict(layout=Layout(dp=2, ep=2), model=preset("tiny-dsmoe"))}


def _lagged(monkeypatch):
    """The check read a step late (a GPU's way, faults.LaggedCheck) on these CPU ranks."""
    import playground.training as training
    monkeypatch.setattr(training, "_lags", lambda run, deferred: run.on_nan != "off" and run.dtype != "float16")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "zero3" else n for n in LAGGED])
@pytest.mark.parametrize("at", [2, 4])
def test_a_check_read_a_step_late_skips_the_same_step_on_the_device(name, at, tmp_path, monkeypatch):
    """--on-nan skip with the check read during the next step (the poisoned step's update
    skipped on the device: DDP's AdamW, ZeRO's, the one pass with compute copies, the MoE
    balancing bias): the same losses and weights as the check read at once, bit for bit, and
    the same step reported skipped, also the run's last."""
    kw = dict(steps=4, faults=(Fault("nan", at, 1),), on_nan="skip", **LAGGED[name])
    at_once = train(_run(save=str(tmp_path / "at_once"), **kw))
    _lagged(monkeypatch)
    late = train(_run(save=str(tmp_path / "late"), **kw))
    assert late.losses == at_once.losses and all(x == x for x in late.losses)
    assert [v["skipped_steps"] for v in late.values] == [v["skipped_steps"] for v in at_once.values] == [[at]] * 2
    a, b = export(str(tmp_path / "at_once")), export(str(tmp_path / "late"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_check_read_a_step_late_stops_with_the_weights_before_the_poisoned_step(monkeypatch):
    _lagged(monkeypatch)
    with pytest.raises(NonFiniteError, match=r"step 2: a NaN or an Inf in the gradient of .* on rank 1; stopped before "
                                             r"the optimizer step; its update and step 3's were not made"):
        train(_run(faults=(Fault("nan", 2, 1),)))
    with pytest.raises(NonFiniteError, match=r"step 4: .* on rank 0; its update was not made \(the run's last step\)"):
        train(_run(faults=(Fault("nan", 4, 0),)))


def test_unchecked_a_nan_spreads_silently():
    """--on-nan off: nothing stops it, and the loss turns NaN (what the check is for)."""
    res = train(_run(steps=3, faults=(Fault("nan", 1, 1),), on_nan="off"))
    assert any(x != x for x in res.losses)


def test_a_slow_rank_is_a_straggler_on_simulated_time():
    run = _run(steps=4, hardware="h100-sxm", faults=(Fault("slow", 3, 1, factor=4.0),))
    res = train(run)
    idle = [s["idle"] for s in res.values[0]["sim_steps"]]
    assert idle[2] > 3 * max(idle[0], 1e-6) and idle[3] > 3 * max(idle[0], 1e-6)
    assert res.values[1]["sim_steps"][3]["time"] > 2 * res.values[1]["sim_steps"][0]["time"]


# -- restart ------------------------------------------------------------------------------------
RESTART_LAYOUTS = {
    "ddp": Layout(dp=2),
    "zero3": Layout(dp=2, zero=3),
    "tp2-sp": Layout(tp=2, sequence_parallel=True),
    "pp2": Layout(pp=2, microbatches=2),
    "cp2": Layout(cp=2),
    "ep2": Layout(dp=2, ep=2),
}


def _same_run(layout, dtype, tmp_path, faults):
    model = preset("tiny-moe") if layout.ep > 1 else preset("tiny")
    kw = dict(model=model, dtype=dtype, save_every=2)
    whole = train(_run(layout, steps=6, save=str(tmp_path / "whole"), **kw))
    again = train(_run(layout, steps=6, save=str(tmp_path / "again"), faults=faults, max_restarts=len(faults),
                       timeout=1.5, **kw))
    a, b = export(str(tmp_path / "whole")), export(str(tmp_path / "again"))
    return whole, again, a, b


@pytest.mark.parametrize("name,dtype", [pytest.param(n, d, marks=() if (n, d) == ("zero3", "float64")
                                                     else pytest.mark.slow)
                                        for n in RESTART_LAYOUTS for d in ("float64", "float32")])
def test_a_restart_after_a_crash_continues_the_same_run_bitwise(name, dtype, tmp_path):
    whole, again, a, b = _same_run(RESTART_LAYOUTS[name], dtype, tmp_path, (Fault("crash", 5, 1),))
    assert [(r.fault, r.failed_step, r.resumed_from, r.steps_recomputed) for r in again.restarts] == \
        [("crash@5:1", 5, 4, 0)]
    assert again.losses == whole.losses[4:]  # the steps after the checkpoint, bit for bit
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.slow
def test_a_restart_after_a_hang_and_a_crash_recomputes_what_the_checkpoint_lacked(tmp_path):
    whole, again, a, b = _same_run(Layout(dp=2), "float32", tmp_path,
                                   (Fault("hang", 4, 0), Fault("crash", 6, 1)))
    hang, crash = again.restarts
    assert (hang.fault, hang.resumed_from, hang.steps_recomputed) == ("hang@4:0", 2, 1)
    assert "timeout" in hang.detected and hang.wall_lost_s >= 1.0
    assert (crash.fault, crash.resumed_from, crash.steps_recomputed) == ("crash@6:1", 4, 1)
    assert again.losses == whole.losses[4:] and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.slow
def test_an_elastic_restart_continues_on_fewer_ranks_as_a_run_that_changed_layout_there(tmp_path):
    """dp 4 loses rank 1 for good at step 5: the restart continues on dp 3 from the checkpoint
    of step 4, the global batch of 12 kept by 4 microbatches instead of 3, the checkpoint
    resharded; it ends where a run that moved to dp 3 at step 4 ends (float64), and within the
    check's tolerance of one that never left dp 4."""
    four, three = Layout(dp=4, micro_batch_size=1, microbatches=3), Layout(dp=3, micro_batch_size=1, microbatches=4)
    kw = dict(dtype="float64", save_every=2)
    again = train(_run(four, steps=6, save=str(tmp_path / "again"), max_restarts=1, elastic=2,
                       faults=(Fault("crash", 5, 1, permanent=True), Fault("crash", 6, 3)), **kw))
    (r,) = again.restarts
    assert (r.fault, r.resumed_from, r.layout) == ("crash!@5:1", 4, three.describe())
    assert again.run.layout == three and again.run.faults == ()  # (rank 3 is no more: its fault went with it)
    train(_run(four, steps=4, save=str(tmp_path / "moved"), **kw))
    moved = train(_run(three, steps=6, save=str(tmp_path / "moved"), resume=str(tmp_path / "moved"), **kw))
    whole = train(_run(four, steps=6, save=str(tmp_path / "whole"), **kw))
    assert again.losses == moved.losses
    a, b, c = export(str(tmp_path / "again")), export(str(tmp_path / "moved")), export(str(tmp_path / "whole"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.allclose(a[n], c[n], rtol=1e-10, atol=1e-12) for n in a)
    assert max(abs(x - y) for x, y in zip(again.losses, whole.losses[4:])) < 1e-12


def test_an_elastic_restart_that_cannot_keep_the_batch_says_why(tmp_path):
    with pytest.raises(RankFailedError, match=r"the global batch of 8 sequences does not split over dp 3"):
        train(_run(Layout(dp=4, micro_batch_size=2), steps=4, save=str(tmp_path / "a"), max_restarts=1, elastic=2,
                   faults=(Fault("crash", 2, 0, permanent=True),)))
    with pytest.raises(RankFailedError, match=r"1 ranks are left, fewer than --elastic 2"):
        train(_run(Layout(dp=2, micro_batch_size=2), steps=4, save=str(tmp_path / "b"), max_restarts=1, elastic=2,
                   faults=(Fault("crash", 2, 0, permanent=True),)))


def test_restarts_are_bounded_and_a_rank_lost_for_good_is_not_restarted(tmp_path):
    with pytest.raises(RankFailedError):  # two crashes, one restart
        train(_run(steps=6, save=str(tmp_path / "a"), save_every=2, max_restarts=1,
                   faults=(Fault("crash", 3, 1), Fault("crash", 5, 0))))
    with pytest.raises(RankFailedError, match="lost for good"):
        train(_run(steps=6, save=str(tmp_path / "b"), save_every=2, max_restarts=1,
                   faults=(Fault("crash", 3, 1, permanent=True),)))
    with pytest.raises(ValueError, match="--max-restarts 1 restarts from the last checkpoint: it needs --save"):
        _run(max_restarts=1)


# -- the command line and torchrun --------------------------------------------------------------
def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "playground", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)


def test_the_report_tells_what_each_fault_cost(tmp_path):
    from playground.report import train_summary
    res = train(_run(steps=6, save=str(tmp_path / "r"), save_every=2, max_restarts=1, on_nan="skip",
                     faults=(Fault("crash", 5, 1), Fault("nan", 3, 0))))
    text = train_summary(res)
    assert "crash@5:1" in text and "rank 1 raised InjectedCrash" in text and "restart from step 4" in text
    assert "the step skipped on every rank" in text


@pytest.mark.parametrize("layout", [Layout(dp=2), Layout(dp=2, pp=2, microbatches=2)], ids=["dp2", "dp2-pp2"])
def test_under_fp16_the_report_says_the_loss_scaler_skipped_a_poisoned_step(layout):
    """fp16: a NaN in a gradient is the loss scaler's overflow (the NaN check reads the loss
    alone): the step is skipped on every rank and the scale halved, and the report says so,
    naming the scaler, not the NaN check, as what found it."""
    from playground.report import train_summary
    from playground.summary import train_json
    res = train(_run(layout, steps=3, dtype="float16", faults=(Fault("nan", 2, layout.world - 1),)))
    assert all(v["overflow_steps"] == [2] and v["loss_scale"] == 2.0 ** 15 for v in res.values)
    text = train_summary(res)
    assert "fp16 loss scaling: scale 32,768 after the last step; step 2 skipped for an overflow" in text
    assert "the fp16 loss scaler's overflow check" in text and "the loss scale halved" in text
    assert train_json(res)["loss_scaling"] == {"scale": 2.0 ** 15, "overflow_steps": [2]}
    clean = train(_run(layout, steps=2, dtype="float16"))
    assert "fp16 loss scaling: scale 65,536 after the last step; no step overflowed" in train_summary(clean)


@pytest.mark.slow
def test_the_command_line_tells_what_each_fault_cost(tmp_path):
    out = _cli("train", "--dp", "2", "--steps", "6", "--save", str(tmp_path / "c"), "--save-every", "2",
               "--inject", "crash@5:1", "--inject", "nan@3:0", "--on-nan", "skip", "--max-restarts", "1",
               "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "restart 1 of 1 from the checkpoint at step 4" in out.stderr and "step 3 skipped" in out.stderr
    assert "crash@5:1" in out.stdout and "rank 1 raised InjectedCrash" in out.stdout
    assert "the step skipped on every rank" in out.stdout
    bad = _cli("train", "--inject", "crash@x:1")
    assert bad.returncode == 2 and "--inject 'crash@x:1'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_fault_before_the_resumed_checkpoint_is_refused_as_one_that_never_fires(tmp_path, cli):
    ck = tmp_path / "ck"
    assert cli("train", "--dp", "2", "--steps", "3", "--save", ck, "--no-progress")[0] == 0
    status, out, err = cli("train", "--dp", "2", "--steps", "6", "--resume", ck, "--inject", "crash@3:1")
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert "--inject crash@3:1: step 3 is not after the checkpoint's step 3 that --resume continues from" in err
    status, out, err = cli("train", "--dp", "2", "--steps", "5", "--resume", ck, "--inject", "slow:2@2:1",
                           "--no-progress")
    assert status == 0, err  # a slow rank stays slow from its step on: it still applies


@pytest.mark.slow
def test_torchrun_restarts_a_crashed_job_that_resumes_auto(tmp_path):
    """Under torchrun (gloo on the CPU), --resume auto makes torchrun's own --max-restarts
    continue the run from the newest checkpoint: the final weights are the uninterrupted run's."""
    base = ["--dp", "2", "--steps", "6", "--save-every", "2", "--backend", "torch", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # (gloo, also where a GPU is)

    def torchrun(*args, restarts=0):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--max-restarts", str(restarts), "-m", "playground", "train", *base, *args],
                              capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    whole = torchrun("--save", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    again = torchrun("--save", str(tmp_path / "again"), "--resume", "auto", "--inject", "crash@5:1", restarts=1)
    assert again.returncode == 0, again.stderr[-2000:]
    a, b = export(str(tmp_path / "whole")), export(str(tmp_path / "again"))
    assert all(torch.equal(a[n], b[n]) for n in a)


# -- planning for failures ----------------------------------------------------------------------
def test_young_and_daly_intervals_and_the_goodput_they_maximise():
    from playground.goodput import daly_interval, goodput, young_interval
    delta, mtbf, restart = 30.0, 6 * 3600.0, 120.0
    assert young_interval(delta, mtbf) == pytest.approx((2 * delta * mtbf) ** 0.5)
    tau = daly_interval(delta, mtbf)
    assert abs(tau - young_interval(delta, mtbf)) < 0.05 * tau  # δ << M: Daly's is Young's, nearly
    best = max((goodput(t, delta, mtbf, restart), t) for t in [tau * f / 100 for f in range(20, 500)])
    assert best[1] == pytest.approx(tau, rel=0.03) and goodput(tau, delta, mtbf, restart) < 1
    assert daly_interval(3 * mtbf, mtbf) == mtbf  # δ beyond 2M: checkpoint every M


def test_a_plan_says_what_a_checkpoint_costs_and_when_to_take_it():
    from playground.goodput import checkpoint_bytes, failure_plan
    cfg = preset("7b")
    assert checkpoint_bytes(cfg, Layout(dp=8)) == 12 * cfg.n_params()  # one rank writes its replica
    assert checkpoint_bytes(cfg, Layout(dp=8, zero=1)) == -(-12 * cfg.n_params() // 8)
    assert checkpoint_bytes(cfg, Layout(dp=4, tp=2, zero=3)) == -(-12 * cfg.n_params() // 8)
    f = failure_plan(cfg, Layout(dp=64, zero=3), step_s=2.0, gbps=1.0, mtbf_hours=50_000)
    assert f.write_s == pytest.approx(f.bytes_per_rank / 1e9)
    assert f.mtbf_s == pytest.approx(50_000 * 3600 / 64) and 0.9 < f.goodput < 1
    assert f.goodput > f.goodput_every_step


@pytest.mark.slow
def test_plan_prints_the_checkpoint_and_its_interval():
    out = _cli("plan", "--dp", "2", "--hardware", "h100-sxm", "--mtbf-hours", "1000")
    assert out.returncode == 0 and "checkpoint every" in out.stdout and "Daly 2006" in out.stdout


@pytest.mark.slow
def test_on_gloo_a_hang_is_found_and_a_crash_restarts_the_same_run(tmp_path):
    """The same faults on gloo processes: the async all-reduce a hung peer never joins times out
    (torch's own wait for ever, bounded here), and a restart continues the run bit for bit."""
    t = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"waited 3 s in all_reduce"):
        train(_run(steps=3, backend="gloo", faults=(Fault("hang", 2, 1),), timeout=3))
    assert time.monotonic() - t < 120
    kw = dict(steps=6, backend="gloo", save_every=2)
    train(_run(save=str(tmp_path / "whole"), **kw))
    again = train(_run(save=str(tmp_path / "again"), faults=(Fault("crash", 5, 1),), max_restarts=1, **kw))
    assert [(r.fault, r.resumed_from) for r in again.restarts] == [("crash@5:1", 4)]
    a, b = export(str(tmp_path / "whole")), export(str(tmp_path / "again"))
    assert all(torch.equal(a[n], b[n]) for n in a)
