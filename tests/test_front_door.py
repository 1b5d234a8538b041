"""The front door as a new user meets it: the installed command from another directory,
bad input refused in one line before any rank starts, Ctrl-C, rank processes that die
with their launcher, help, the JSON summary, the report and the plots."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "playground", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


# -- packaging --------------------------------------------------------------------------------
@pytest.mark.slow
def test_installed_command_works_from_another_directory(tmp_path):
    """A non-editable install into a fresh virtual environment (torch reused from the system
    site packages), then the installed `playground` run from a temporary directory: every
    package it imports must have been installed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    p = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps",
                        "--disable-pip-version-check", ROOT], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    exe = str(venv / "bin" / "playground")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([exe, "--help"], capture_output=True, text=True, cwd=work, env=env, timeout=60)
    assert p.returncode == 0 and "train" in p.stdout, p.stderr
    p = subprocess.run([exe, "check", "--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2",
                        "--steps", "1", "--dtype", "float64", "--json", "c.json"],
                       capture_output=True, text=True, cwd=work, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads((work / "c.json").read_text())["passed"] is True
    p = subprocess.run([exe, "bench"], capture_output=True, text=True, cwd=work, env=env, timeout=60)
    assert p.returncode == 0 and "zero" in p.stdout and "pipeline" in p.stdout
    # the code it ran is the installed copy, not this checkout
    where = subprocess.run([str(py), "-c", "import playground, pipeline, simulator; print(pipeline.__file__)"],
                           capture_output=True, text=True, cwd=work, env=env).stdout
    assert "site-packages" in where


# -- bad input: one line, exit status 2, no traceback --------------------------------------
def _data_files(d):
    np.save(d / "floats.npy", np.random.rand(1000))
    np.save(d / "negative.npy", np.array([-3, 1, 2] * 100))
    np.save(d / "large.npy", np.array([1, 2, 300] * 100))
    np.save(d / "short.npy", np.array([1, 2, 3]))
    (d / "empty.bin").write_bytes(b"")
    (d / "odd.bin").write_bytes(b"abc")


@pytest.mark.parametrize("args,message", [
    (["--data", "missing.txt"], "--data missing.txt: no such file"),
    (["--data", "empty.bin"], "--data empty.bin: the file is empty"),
    (["--data", "odd.bin"], "3 bytes, an odd number"),
    (["--data", "floats.npy"], "holds float64 values; token ids must be integers"),
    (["--data", "negative.npy"], "holds the negative token id -3"),
    (["--data", "large.npy"], "holds token id 300, outside the model's vocab_size=64"),
    (["--data", "short.npy"], "has 3 tokens, fewer than one sequence of seq_len+1 = 33"),
    (["--world", "100000"], "world=100000 on simulated ranks needs about"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--backend", "torch"], "RANK/WORLD_SIZE are not set"),
    (["--tp", "3"], "n_heads=4 is not divisible by tp=3"),
    (["--json", "."], "--json .: is a folder"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path, cli, monkeypatch):
    _data_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    status, out, err = cli("train", *args, "--no-progress")
    assert status == 2, out + err
    assert err.count("\n") == 1 and message in err and out == ""
    assert time.monotonic() - t0 < 60  # before any rank starts (--world 100000 took minutes)


def test_the_world_estimate_names_the_largest_world_that_fits():
    from model import preset
    from playground import Layout, RunConfig
    from playground.capacity import check_simulated_memory
    run_ = RunConfig(model=preset("small"), layout=Layout(dp=512, tp=2))
    with pytest.raises(ValueError, match=r"the largest that fits is world (\d+) \(dp=(\d+) × 2\)") as e:
        check_simulated_memory(run_, available=8 * 2**30)
    world = int(str(e.value).split("world ")[-1].split(" ")[0])
    check_simulated_memory(RunConfig(model=preset("small"), layout=Layout(dp=world // 2, tp=2)),
                           available=8 * 2**30)  # and that one passes


# -- interrupts and processes ---------------------------------------------------------------
def _terminal_sigint():
    """In the child: Ctrl-C's default disposition, as a terminal gives it. A shell starts a
    background job (`.ci/run &`) with SIGINT ignored, and its children inherit that, so
    without this the tests below would see an interrupt ignored that a user never would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.15, 0.5, 0.8, 1.0, 1.1, 1.2, 1.4, 4.0])
def test_ctrl_c_stops_a_simulated_run_with_one_line_and_status_130(after):
    """At any moment: importing the command (0.15 s), importing torch (0.5-1.4 s here; an
    interrupted import of torch leaves its submodules behind, and the interpreter's teardown
    then died by the signal, status -2), ranks running (4 s)."""
    p = subprocess.Popen([sys.executable, "-m", "playground", "train", "--world", "4", "--steps", "5000",
                          "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_terminal_sigint)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 130, err
    assert err.strip() in ("playground train: interrupted", "playground: interrupted"), err


def test_ctrl_c_that_python_would_ignore_stops_the_command_too():
    """A KeyboardInterrupt raised where Python only prints exceptions ("Exception ignored in":
    the import system's module-lock callback while torch imports, a `__del__`) was lost, and
    the run went on; within `interrupts_never_ignored` it stops the process as an answered
    Ctrl-C does, and any other ignored exception is still only printed."""
    program = ("from playground.interrupts import interrupts_never_ignored\n"
               "class Dying:\n"
               "    def __init__(self, e): self.e = e\n"
               "    def __del__(self): raise self.e\n"
               "with interrupts_never_ignored(lambda: 'playground train'):\n"
               "    Dying(ValueError('only printed'))\n"
               "    print('went on')\n"
               "    Dying(KeyboardInterrupt())\n"
               "    print('went on after the interrupt')\n")
    p = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert p.returncode == 130, p.stderr
    assert p.stdout == "went on\n"
    assert "ValueError: only printed" in p.stderr and p.stderr.strip().endswith("playground train: interrupted")


def test_ctrl_c_inside_a_class_definition_is_an_interrupt_too(monkeypatch, capsys):
    """Ctrl-C while a module defines a dataclass reaches the command as the RuntimeError
    "Error calling __set_name__ ...", raised from the KeyboardInterrupt (it landed there once,
    1.4 s into a run, importing playground/parallelize.py): one line and 130 all the same."""
    import playground.cli as cli

    def interrupted_import(args, given):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as k:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance 'loss_terms'") from k

    monkeypatch.setattr(cli, "_main", interrupted_import)
    monkeypatch.setattr(cli.os, "_exit", lambda code: None)  # (torch is imported in this process)
    assert cli.main(["train", "--world", "2"]) == 130
    assert capsys.readouterr().err.strip() == "playground train: interrupted"


def _children(pid):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d))
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc (Linux)")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_gloo_ranks_die_with_their_launcher_and_the_folder_goes(how):
    p = subprocess.Popen([sys.executable, "-m", "playground", "train", "--backend", "gloo", "--world", "2",
                          "--steps", "100000", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, preexec_fn=_terminal_sigint)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        kids = _children(p.pid)
        made = set(glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"playground-gloo-{p.pid}-*")))
        if len(kids) >= 2 and made and all(os.path.exists(os.path.join(d, "store")) for d in made):
            break
        time.sleep(0.2)
    else:
        p.kill()
        pytest.fail("the gloo ranks did not start")
    time.sleep(2)  # training
    if how == "SIGKILL":
        os.kill(p.pid, signal.SIGKILL)  # the launcher runs no cleanup at all
    else:
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C in a terminal reaches the whole process group
    _, err = p.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (any(_alive(k) for k in kids) or any(os.path.exists(d) for d in made)):
        time.sleep(0.1)
    assert not [k for k in kids if _alive(k)], "rank processes outlived their launcher"
    assert not [d for d in made if os.path.exists(d)], "the launcher's temporary folder was left behind"
    if how == "SIGINT":
        assert p.returncode == 130 and err.strip() == "playground train: interrupted"


# -- help and output ----------------------------------------------------------------------------
def test_help_does_not_import_torch_and_every_flag_has_help():
    code = ("import sys, playground.flags as c\n"
            "p = c.parser()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "sub = p._subparsers._group_actions[0].choices\n"
            "for verb in ('train', 'check', 'plan', 'calibrate'):\n"
            "    for a in sub[verb]._actions:\n"
            "        assert a.help, (verb, a.option_strings)\n"
            "print(sub['train'].format_help())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "(default: tiny)" in text and "(default: 1f1b)" in text and "--json" in text
    v = run("--version")
    assert v.returncode == 0 and v.stdout.startswith("playground ")


def test_bench_lists_the_benchmarks():
    p = run("bench")
    assert p.returncode == 0
    for name in ("zero", "pipeline", "tensor_parallel", "ddp_vs_gloo", "clock_overhead", "collectives"):
        assert f"  {name} " in p.stdout
    p = run("bench", "nope")
    assert p.returncode == 2 and "choose one of" in p.stderr


@pytest.mark.slow
def test_train_json_summary(tmp_path):
    path = tmp_path / "train.json"
    p = run("train", "--dp", "2", "--tp", "2", "--steps", "3", "--no-progress", "--hardware", "h100-sxm",
            "--json", str(path))
    assert p.returncode == 0, p.stderr
    d = json.loads(path.read_text())
    assert d["schema"] == "playground.train/1"
    assert d["layout"]["world"] == 4 and d["layout"]["tp"] == 2 and d["model"]["n_params"] > 0
    assert len(d["loss"]["per_step"]) == 3 and d["loss"]["floor"] > 0 and d["throughput"]["tokens_per_s"] > 0
    assert [m["rank"] for m in d["memory"]] == [0, 1, 2, 3]
    assert all(m["parameters"] > 0 and m["peak_activations"] > 0 for m in d["memory"])
    comm = {(c["rank"], c["label"]): c for c in d["communication"]}
    assert comm[(0, "tp.attn.g")]["calls_per_step"] == 2 and comm[(0, "tp.attn.g")]["algorithms"]
    assert comm[(0, "ddp.broadcast")]["setup"] is True
    assert all(c["bytes_sent_per_step"] + c["bytes_received_per_step"] > 0 for c in d["communication"])
    sim = d["simulated"]
    assert sim["hardware"] == "h100-sxm" and len(sim["per_rank"]) == 4
    for r in sim["per_rank"]:
        assert r["step_s"] == pytest.approx(r["compute_s"] + r["host_s"] + r["exposed_comm_s"] + r["idle_s"])


@pytest.mark.slow
def test_check_json_and_plot(tmp_path):
    p = run("check", "--dp", "2", "--zero", "3", "--dtype", "float64", "--json", str(tmp_path / "c.json"),
            "--plots", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads((tmp_path / "c.json").read_text())
    assert d["schema"] == "playground.check/2" and d["passed"] is True and d["problems"] == []
    grads = [e for e in d["errors"] if e["quantity"] == "grad"]
    assert {e["tensor"] for e in grads} >= {"tok_emb.weight", "blocks.1.mlp.w_down.weight"}
    assert all(e["ok"] and e["max_rel"] <= d["tolerance"]["grad"] and e["ratio"] <= 1 for e in grads)
    assert 0 < d["ratio"] <= 1 and {e["quantity"] for e in d["errors"]} == {"loss", "grad", "weight", "moments"}
    data = (tmp_path / "check.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_report_names_ranks_leaves_out_silent_labels_and_names_algorithms():
    p = run("train", "--tp", "2", "--steps", "2", "--no-progress", "--hardware", "h100-sxm")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    # dp = 1: DDP's bucket all-reduce and the loss all-reduce move nothing, so they are not listed
    assert "ddp.bucket" not in out and "metrics.loss " not in out
    table = out[out.index("communication per rank per step"):]
    assert "algorithm" in table and "recursive_doubling" in table  # the cost model's choice, named
    assert "rank 0" in out


def test_plots_give_every_label_its_own_colour():
    from playground.plots import distinct_colors
    for n in (3, 10, 16, 25, 40):
        colors = distinct_colors(n)
        assert len({tuple(round(x, 6) for x in c) for c in colors}) == n
