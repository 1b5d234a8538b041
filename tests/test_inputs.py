"""Every input checked before the work (playground/flags.py, playground/inputs.py): a bad
flag, a flag that would do nothing, an output that cannot be written, a malformed file,
each one line naming the flag and the values, exit status 2, before any rank starts and
(where no tensor is needed) before torch is imported."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args,message", [
    (["train", "--world", "0"], "--world 0: must be at least 1"),
    (["train", "--lr", "nan"], "--lr nan: must be a finite number above 0"),
    (["train", "--lr", "inf"], "--lr inf: must be a finite number above 0"),
    (["train", "--lr", "-1"], "--lr -1: must be a finite number above 0"),
    (["train", "--seed", "-1"], "--seed -1: must be at least 0"),
    (["train", "--micro-batch-size", "1.5"], "--micro-batch-size 1.5: not a whole number"),
    (["train", "--model", "nonexistent"], "--model nonexistent: choose one of 125m,"),
    (["train", "--bucket-mb", "nan"], "--bucket-mb nan: must be a finite number above 0"),
    (["train", "--model", "tiny-moe", "--capacity-factor", "-1"], "--capacity-factor -1: must be a finite number"),
    (["train", "--model", "tiny-moe", "--top-k", "9"], "top_k=9 must be between 1 and n_experts=4 (--top-k)"),
    (["train", "--schedule", "zb1"], "--schedule zb1 needs --pp 2 or more"),
    (["train", "--cp-impl", "ulysses"], "--cp-impl ulysses needs --cp 2 or more"),
    (["train", "--top-k", "2"], "--top-k sets the experts' routing, and model tiny has none"),
    (["train", "--dp", "2", "--zero", "1", "--bucket-mb", "10"], "--bucket-mb sizes DDP's buckets"),
    (["train", "--overwrite"], "--overwrite replaces a checkpoint: it needs --save DIR"),
    (["train", "--model-config", "n_layers=2,n_layers=3"], "--model-config: n_layers given twice"),
    (["train", "--model-config", "n_layers=0"], "n_layers=0 must be a whole number of at least 1 (--model-config)"),
    (["train", "--model-config", "norm_eps=-1"], "norm_eps=-1.0 must be >= 0 (--model-config)"),
    (["train", "--model-config", "rope_base=0"], "rope_base=0.0 must be > 0 (--model-config)"),
    (["train", "--seq-len", "64", "--model-config", "seq_len=32"], "give it once"),
    (["train", "--hardware", "bad.json"], "hardware file 'bad.json': not valid JSON"),
    (["train", "--json", "afile/x.json"], "--json afile/x.json:"),
    (["train", "--plots", "afile"], "--plots afile: exists and is not a folder"),
    (["train", "--save", "afile/ck"], "--save afile/ck:"),
    (["train", "--dp", "2", "--global-batch-size", "16", "--microbatches", "3"], "--global-batch-size 16 means 2"),
    (["train", "--dp", "3", "--global-batch-size", "10"], "--global-batch-size 10 is not divisible by dp"),
    (["train", "--autocast"], "--autocast is a recipe of --dtype bfloat16, not of --dtype float32"),
    (["check", "--bf16-copies"], "--bf16-copies is a recipe of --dtype bfloat16, not of --dtype float64"),
    (["train", "--dtype", "bfloat16", "--dp", "2", "--zero", "2", "--autocast"],
     "--autocast with --zero 2: ZeRO computes in its own bf16 compute copies of fp32 masters; give one of them"),
    (["train", "--dtype", "bfloat16", "--autocast", "--bf16-copies"], "--bf16-copies: not allowed with argument --autocast"),
    (["train", "--tpp", "2"], "--tpp: not a flag of playground train; did you mean --tp or --pp?"),
    (["train", "--tensor-model-parallel-size", "2"], "it is --tp here"),
    (["plan", "--hardware", "h100-sxm", "--save", "ck"], "--save is not a flag of plan: it belongs to train"),
    (["plan", "--model", "tiny"], "--hardware is required"),
    (["plan", "--hardware", "h100-sxm", "--top", "3"], "--top is an option of --search: add --search"),
    (["check", "--hardware", "h100-sxm"], "--hardware is not a flag of check"),
    (["calibrate", "--backend", "gloo", "--world", "2", "--max-mib", "-5", "--out", "c.json"],
     "--max-mib -5: must be a finite number above 0"),
    (["calibrate", "--backend", "gloo", "--world", "2", "--model", "tiny", "--out", "afile/c.json"],
     "--out afile/c.json:"),
    (["export", "ck", "afile/gpt.pt"], "afile/gpt.pt:"),
    (["train", "--tp"], "--tp: give a value"),
    ([], "give a verb: train, check, plan"),
])
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(args, message, tmp_path, cli, monkeypatch):
    (tmp_path / "bad.json").write_text("{name: 'h100', peak_tflops: 989,}\n")
    (tmp_path / "afile").write_text("a plain file: nothing can be written under it\n")
    (tmp_path / "ck").mkdir()
    monkeypatch.chdir(tmp_path)
    status, out, err = cli(*args)
    assert status == 2, out + err
    assert err.count("\n") == 1 and message in err and out == "", err
    assert "Traceback" not in err and "usage:" not in err


@pytest.mark.parametrize("field,value,message", [
    ("peak_bf16_flops", -1, "peak_bf16_flops = -1 must be a finite number above 0"),
    ("matmul_fraction", 1.5, "matmul_fraction = 1.5 must be a fraction of the peak, in (0, 1]"),
    ("gpus_per_node", 0, "gpus_per_node = 0 must be a finite number above 0"),
    ("kernel_floor", float("nan"), "kernel_floor = nan must be a finite number at least 0"),
    ("nvlink_latency", -1e-6, "nvlink_latency = -1e-06 must be a finite number at least 0"),
    ("selective_floor", -2e-5, "selective_floor = -2e-05 must be a finite number at least 0"),
    ("hbm_bandwidth", 0, "hbm_bandwidth = 0 must be above 0 (inf: no cost per byte)"),
    ("peak_bf16_flops", float("inf"), "peak_bf16_flops = inf must be a finite number above 0"),
    ("matmul_tiles", [[128, 0]], "matmul_tiles = [[128, 0]] must be pairs of tile sides above 0"),
    ("attention_table", {"64": [[1024, 2.0]]}, "must map head dimensions above 0 to (sequence above 0, fraction in (0, 1]) pairs"),
])
def test_a_profile_out_of_range_is_refused_naming_the_field(field, value, message, tmp_path, cli):
    """A hardware file whose numbers cannot be a GPU's (a negative peak, a fraction over 1, no
    GPUs per node, NaN) is refused in one line, not planned (nor divided by)."""
    status, out, err = _plan_on_h200_with(field, value, tmp_path, cli)
    assert status == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_a_profile_may_say_a_bandwidth_costs_nothing(tmp_path, cli):
    """An infinite bandwidth (calibrate's fit where a collective's time did not grow with its
    size, as on one host's gloo) is a profile's number, planned as no cost per byte."""
    status, out, err = _plan_on_h200_with("nvlink_bandwidth", float("inf"), tmp_path, cli)
    assert status == 0, err


def _plan_on_h200_with(field, value, tmp_path, cli):
    """`plan --dp 2` on the h200 profile with one field set to `value`: (status, out, err)."""
    from simulator.hardware import load_hardware
    (tmp_path / "p.json").write_text(json.dumps({**load_hardware("h200").to_dict(), field: value}))
    return cli("plan", "--dp", "2", "--hardware", tmp_path / "p.json")


def _bare(args: list) -> subprocess.CompletedProcess:
    """The command in a fresh interpreter, reporting whether torch was imported."""
    code = ("import sys\nfrom playground.cli import main\ncode = main(sys.argv[1:])\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\nsys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("args", [
    ["train", "--tp", "3"],  # the layout against the model
    ["train", "--schedule", "zb1"],  # a flag that would do nothing
    ["train", "--json", "/proc/x.json"],  # an output that cannot be written
    ["plan", "--hardware", "h100-sxm", "--dp", "3", "--global-batch-size", "10"],
    ["train", "--hardware", "nope"],
])
def test_checks_that_need_no_tensor_answer_before_torch_is_imported(args):
    p = _bare(args)
    assert p.returncode == 2 and p.stderr.strip().endswith("no torch"), p.stderr


def test_a_flag_given_is_told_from_a_default():
    from playground.flags import given
    assert given(["train", "--dp", "2", "--schedule=zb1", "--sp"]) == {"--dp", "--schedule", "--sp"}
    assert given(["bench", "zero", "--", "--dp", "2"]) == set()


def test_global_batch_size_sets_the_microbatches(cli, tmp_path):
    status, out, err = cli("train", "--dp", "2", "--micro-batch-size", "2", "--global-batch-size", "12", "--steps", "1",
                           "--no-progress", "--json", tmp_path / "t.json")
    assert status == 0, err
    layout = json.loads((tmp_path / "t.json").read_text())["layout"]
    assert layout["microbatches"] == 3 and layout["global_batch"] == 12


def test_help_lists_only_what_each_verb_accepts_with_its_default():
    from playground.flags import parser
    verbs = parser().verbs
    text = {v: verbs[v].format_help() for v in verbs}
    for flag in ("--save", "--resume", "--data", "--seed", "--steps", "--backend", "--count-every-step"):
        assert flag not in text["plan"], flag
    for flag in ("--hardware", "--trace", "--save", "--resume", "--count-every-step", "--no-progress"):
        assert flag not in text["check"], flag
    train = " ".join(text["train"].split()).split("model and layout:")[1]  # (the flags, after the usage)
    assert "(default: 0)" in train.split("--zero {")[1].split("--sp")[0]  # a default of 0 is shown
    assert "(default: 0)" in train.split("--seed")[1].split("--data")[0]
    assert train.split("--ac {")[1].split("--seq-len")[0].count("default") == 1
    moe = train.split("mixture of experts")[1].split("training:")[0]
    assert "--capacity-factor" in moe and "--dropless" in moe
    assert "Megatron --tensor-model-parallel-size" in train
    usage = " ".join(text["plan"].split("\n\n")[0].split())
    assert "--hardware HARDWARE" in usage and "[--hardware" not in usage  # required
    for verb in verbs:
        for a in verbs[verb]._actions:
            assert a.help, (verb, a.option_strings)


def test_a_long_run_is_announced_with_its_estimate(cli, monkeypatch):
    """A run estimated above LONG_RUN_S is announced in one line before it starts (here the
    threshold is lowered so that a one-step run crosses it), and the estimate of
    --seq-len 100000 on the tiny model is hours on a machine of 1e11 FLOP/s."""
    from model.config import preset
    from playground import Layout, RunConfig
    from playground import cli as command
    from playground.capacity import estimated_seconds
    long = RunConfig(model=preset("tiny", seq_len=100_000), layout=Layout())
    assert estimated_seconds(long, 20, rate=1e11) > 3600
    monkeypatch.setattr(command, "LONG_RUN_S", -1)
    status, out, err = cli("train", "--steps", "1", "--no-progress")
    assert status == 0 and err.startswith("playground train: ") and "model FLOPs a step: at least" in err


def test_a_plan_whose_model_states_cannot_fit_says_so_at_once(cli, tmp_path):
    from simulator.hardware import load_hardware
    hw = load_hardware("h100-sxm").to_dict()
    hw.update(name="small-hbm", hbm_capacity=2**16)  # 64 KiB of HBM
    (tmp_path / "small.json").write_text(json.dumps(hw))
    status, out, err = cli("plan", "--hardware", tmp_path / "small.json")
    assert status == 0 and err.count("\n") == 1
    assert "model states alone take" in err and "over small-hbm's 64.00 KiB of HBM by" in err


def test_plan_classes_scale_to_a_hundred_thousand_ranks():
    """The stand-ins' check and the bytes table work per group and per class of ranks:
    linear in the world (dp 100000 took over 7 minutes when each rank listed its groups)."""
    import time

    from collectives import Ledger
    from playground import Layout
    from playground.planning import uniform_stages
    from playground.summary import communication_classes
    t0 = time.perf_counter()
    assert uniform_stages(Layout(dp=100_000), 8)
    assert not uniform_stages(Layout(dp=3, tp=2, pp=2), 8)
    ledger = Ledger(100_000)
    shared = ledger.per_rank[0]
    ledger.per_rank = [shared] * 100_000
    assert communication_classes(ledger, 2) == [(list(range(100_000)), [])]
    assert time.perf_counter() - t0 < 60  # (seconds here; hours before)


def test_bench_writes_outside_the_committed_results(tmp_path, monkeypatch):
    sys.path.insert(0, ROOT)
    from benchmarks._common import default_json
    monkeypatch.chdir(tmp_path)
    assert default_json("zero") == str(tmp_path / "zero.json")
