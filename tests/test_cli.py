"""The `playground` command, end to end in a subprocess."""
import json
import subprocess
import sys

import pytest


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "playground", *args], capture_output=True, text=True,
                          timeout=timeout)


def _labels(path, rank=0):
    return {c["label"] for c in json.loads(path.read_text())["communication"] if c["rank"] == rank}


def test_train_prints_loss_floor_and_bytes(tmp_path):
    p = run("train", "--dp", "2", "--steps", "3", "--no-progress", "--json", str(tmp_path / "t.json"))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "playground train: dp=2 (world 2)" in out
    assert "floor" in out and "tokens/s" in out
    assert {"ddp.bucket0", "metrics.loss", "ddp.broadcast"} <= _labels(tmp_path / "t.json")


def test_check_passes_with_exit_zero_and_prints_every_parameter(cli):
    status, out, err = cli("check", "--world", "3", "--microbatches", "2", "--dtype", "float64")
    assert status == 0, out + err
    assert "PASS" in out and "blocks.1.mlp.w_down.weight" in out and "margin" in out


@pytest.mark.parametrize("verb,dtype", [("train", "float32"), ("check", "float64"), ("plan", "bfloat16")])
def test_each_verb_has_its_own_dtype_and_the_command_line_runs_the_apis_layout(verb, dtype):
    """--dtype's default is the verb's (argparse shares one action among the verbs: a default
    set for plan once made train and check run bfloat16); with no layout flags the command
    line runs what Layout() and RunConfig() give in Python."""
    from playground import Layout, RunConfig
    from playground.flags import parser
    from playground.inputs import run_config
    args = parser().parse_args([verb] + (["--hardware", "h100-sxm"] if verb == "plan" else []))
    run_ = run_config(args, set())
    assert run_.dtype == dtype
    assert run_.layout == Layout() and run_.layout.micro_batch_size == RunConfig().layout.micro_batch_size == 4


@pytest.mark.slow
def test_check_on_gloo_processes():
    """The pieces of every gradient and weight come back from the processes and assemble."""
    p = run("check", "--dp", "2", "--dtype", "float64", "--backend", "gloo")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout and "backend gloo" in p.stdout


@pytest.mark.parametrize("args,message", [
    (["train", "--tp", "3"], "n_heads=4 is not divisible by tp=3"),
    (["check", "--world", "6", "--tp", "4"], "world=6 is not divisible by tp·pp·cp = 4"),
    (["train", "--hardware", "tpu9"], "hardware 'tpu9': not a profile"),
    (["train", "--trace", "t.json"], "--trace needs --hardware"),
])
def test_bad_layouts_exit_2_with_a_message(args, message, cli):
    status, _, err = cli(*args)
    assert status == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_train_on_simulated_hardware():
    p = run("train", "--dp", "2", "--steps", "2", "--no-progress", "--hardware", "h100-sxm")
    assert p.returncode == 0, p.stderr
    assert "simulated on h100-sxm" in p.stdout and "exposed comm" in p.stdout


@pytest.mark.slow
def test_trace_of_simulated_time(tmp_path):
    path = tmp_path / "trace.json"
    p = run("train", "--dp", "3", "--steps", "2", "--no-progress", "--hardware", "a100-80gb", "--trace", str(path))
    assert p.returncode == 0, p.stderr
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2}
    comm = [e for e in spans if e["tid"] == 1]
    assert {e["name"] for e in comm} >= {"ddp.bucket0", "metrics.loss", "ddp.broadcast"}
    for rank in range(3):
        compute = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans if e["pid"] == rank and e["tid"] == 0)
        assert compute and all(a[1] <= b[0] + 1e-6 for a, b in zip(compute, compute[1:]))  # never overlapping


@pytest.mark.slow
def test_plots(tmp_path):
    p = run("train", "--dp", "2", "--steps", "3", "--no-progress", "--hardware", "h200", "--plots", str(tmp_path))
    assert p.returncode == 0, p.stderr
    for name in ("loss.png", "bytes.png", "timeline.png", "memory.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    p = run("train", "--dp", "2", "--steps", "2", "--no-progress", "--plots", str(tmp_path / "plain"))
    assert p.returncode == 0 and sorted(f.name for f in (tmp_path / "plain").iterdir()) == ["bytes.png", "loss.png"]


@pytest.mark.slow
def test_zero_train_and_check(tmp_path):
    p = run("train", "--dp", "3", "--zero", "3", "--steps", "2", "--no-progress", "--json", str(tmp_path / "z.json"))
    assert p.returncode == 0, p.stderr
    assert "memory per rank" in p.stdout and "zero.gather.unit* (5)" in p.stdout  # root (the final norm), embedding, 2 blocks, head
    assert {"zero.gather.unit0", "zero.gather.unit2", "zero.grads.unit1"} <= _labels(tmp_path / "z.json", rank=2)
    p = run("check", "--dp", "2", "--zero", "2", "--dtype", "float64", "--microbatches", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout and "zero=2" in p.stdout


@pytest.mark.slow
def test_tensor_parallel_train_and_check(tmp_path):
    p = run("check", "--tp", "2", "--sp", "--dp", "2", "--dtype", "float64")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout
    p = run("train", "--tp", "4", "--steps", "2", "--no-progress", "--json", str(tmp_path / "t.json"))
    assert p.returncode == 0, p.stderr
    assert {"tp.attn.g", "tp.xent.sumexp"} <= _labels(tmp_path / "t.json", rank=3)


@pytest.mark.slow
def test_pipeline_train_with_schedule_table_and_plot(tmp_path):
    p = run("train", "--pp", "2", "--microbatches", "4", "--schedule", "zb1", "--steps", "2", "--no-progress",
            "--plots", str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "pipeline schedule zb1" in p.stdout and "rank 1: F0" in p.stdout and "pp.activations" in p.stdout
    assert (tmp_path / "schedule.png").stat().st_size > 10_000
    p = run("check", "--pp", "2", "--dp", "2", "--microbatches", "4", "--schedule", "interleaved",
            "--virtual-stages", "2", "--model", "tiny", "--dtype", "float64")
    assert p.returncode == 2 and "n_layers=2 is not divisible by pp·virtual_stages = 2·2 = 4" in p.stderr


@pytest.mark.parametrize("args", [["--dp", "2", "--zero", "3", "--microbatches", "2"],
                                  ["--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2"],
                                  # sequence parallelism's stage output is a strided view, which a
                                  # send refuses (a micro-batch of 1 sequence hid it: that view is dense)
                                  ["--tp", "2", "--sp", "--pp", "2", "--microbatches", "2", "--micro-batch-size", "2"],
                                  # ZeRO-3's expert units under selective checkpointing in bf16: gathered
                                  # inside the checkpointed body, the forward (prefetched) and the
                                  # recomputation (on demand) ran different ops, which torch refused
                                  ["--model", "tiny-moe", "--dp", "2", "--ep", "2", "--zero", "3", "--ac", "selective",
                                   "--dtype", "bfloat16", "--steps", "2"]])
@pytest.mark.slow
def test_new_strategies_on_gloo_processes(args):
    """ZeRO-3, dp × tp × pp, and ZeRO-3 × ep under selective checkpointing, with real processes
    and torch.distributed collectives."""
    p = run("check", "--dtype", "float64", *args, "--backend", "gloo")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout and "backend gloo" in p.stdout
