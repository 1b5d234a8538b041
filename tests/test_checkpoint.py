"""Checkpoints: resuming on the same layout is bit-identical to not stopping; resuming in
another layout matches the uninterrupted run to the check's float64 tolerance; a crash in
the middle of a save leaves the previous checkpoint whole; bad checkpoints are refused in
one line; export and --init-from."""
import json
import os
import subprocess
import sys

import pytest
import torch

from collectives import RankFailedError
from model import GPT, assemble, preset
from playground import Layout, RunConfig, train

CFG = preset("tiny", vocab_size=61, n_layers=2)
MOE = preset("tiny-moe", vocab_size=61)


def _run(layout, steps, dtype="float64", model=CFG, **kw):
    return RunConfig(model=model, layout=layout, steps=steps, dtype=dtype, progress=False, **kw)


def _full(res, what, step=None):
    full, problems = assemble(res.pieces(what, step))
    assert not problems, problems
    return full


def _resumed(a, b, tmp_path, k=2, m=2, dtype="float64", model=CFG):
    """(uninterrupted k + m steps in layout a, k steps in a saved then resumed in b to step
    k + m: --steps is the run's total)."""
    whole = train(_run(a, k + m, dtype, model), collect=True)
    train(_run(a, k, dtype, model, save=str(tmp_path)))
    resumed = train(_run(b, k + m, dtype, model, resume=str(tmp_path)), collect=True)
    return whole, resumed


SAME_LAYOUT = {
    "ddp": (Layout(dp=2, microbatches=2, micro_batch_size=2), CFG),
    "zero3": (Layout(dp=3, zero=3, micro_batch_size=2), CFG),
    "tp2-sp": (Layout(tp=2, sequence_parallel=True, micro_batch_size=2), CFG),
    "pp2-1f1b": (Layout(pp=2, microbatches=3, micro_batch_size=1), CFG),
    "cp2": (Layout(cp=2, dp=2, micro_batch_size=2), CFG),
    "ep2": (Layout(dp=2, ep=2, micro_batch_size=2), MOE),
    # attention dropout: the masks are a function of (seed, rank, layer, step), as the data is
    "dp2-dropout": (Layout(dp=2, micro_batch_size=2), CFG.with_(attention="unfused", attention_dropout=0.1)),
    "pp2-dropout-ac": (Layout(pp=2, microbatches=4, micro_batch_size=1, ac="full"),
                       CFG.with_(attention="unfused", attention_dropout=0.1)),
}


@pytest.mark.parametrize("name,dtype", [pytest.param(n, "float64", marks=pytest.mark.slow) if n in ("cp2", "pp2-dropout-ac")
                                         else (n, "float64") for n in SAME_LAYOUT] + [
    (n, "float32") if n == "zero3" else pytest.param(n, "float32", marks=pytest.mark.slow) for n in SAME_LAYOUT] + [
    # bf16: compute copies of fp32 masters (the copies are rounded from the masters on resume)
    (n, "bfloat16") if n in ("ddp", "ep2") else pytest.param(n, "bfloat16", marks=pytest.mark.slow) for n in SAME_LAYOUT])
def test_resuming_on_the_same_layout_is_bit_identical(name, dtype, tmp_path):
    layout, model = SAME_LAYOUT[name]
    whole, resumed = _resumed(layout, layout, tmp_path, dtype=dtype, model=model)
    assert resumed.start == 2 and resumed.losses == whole.losses[2:]  # every loss, to the bit
    for step in (2, 3):  # every gradient, weight and moment of every resumed step, to the bit
        for what in ("grads", "param", "exp_avg", "exp_avg_sq"):
            a, b = _full(whole, what, step), _full(resumed, what, step)
            assert a.keys() == b.keys()
            for n in a:
                assert torch.equal(a[n], b[n]), (step, what, n)


RESHARD = [
    ("dp4-zero1 -> tp2-pp2", Layout(dp=4, zero=1, micro_batch_size=1),
     Layout(tp=2, pp=2, microbatches=4, micro_batch_size=1)),
    ("dp2-tp2-zero3 -> dp4", Layout(dp=2, tp=2, zero=3, micro_batch_size=2), Layout(dp=4, micro_batch_size=1)),
    ("pp2-dp2 -> dp3-tp2-zero2", Layout(pp=2, dp=2, microbatches=3, micro_batch_size=1),
     Layout(dp=3, tp=2, zero=2, micro_batch_size=2)),
]
RESHARD += [(f"{n.split(' -> ')[1]} -> {n.split(' -> ')[0]}", b, a) for n, a, b in RESHARD]


def _batch(layout):
    return layout.global_batch


@pytest.mark.parametrize("name,a,b", [r if i in (0, 3) else pytest.param(*r, marks=pytest.mark.slow)
                                      for i, r in enumerate(RESHARD)], ids=[r[0] for r in RESHARD])
def test_resuming_in_another_layout_matches_the_uninterrupted_run(name, a, b, tmp_path):
    if _batch(a) != _batch(b):  # the same global batch on both sides: b takes a's batch by microbatches
        b = Layout(**{**b.__dict__, "microbatches": _batch(a) // (b.dp * b.micro_batch_size)})
    whole, resumed = _resumed(a, b, tmp_path)
    for x, y in zip(whole.losses[2:], resumed.losses):
        assert abs(x - y) <= 1e-10 * abs(x)
    for what, step in (("grads", 2), ("param", 3)):
        ref, got = _full(whole, what, step), _full(resumed, what, step)
        for n in ref:
            scale = ref[n].abs().max().item() or 1.0
            assert (ref[n] - got[n]).abs().max().item() <= 1e-10 * scale, (what, n)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    layout = Layout(dp=2, zero=1, micro_batch_size=2)
    train(_run(layout, 2, save=str(tmp_path)))
    before = json.loads((tmp_path / "index.json").read_text())
    import playground.checkpoint as ck
    real = ck._bytes
    calls = {"n": 0}

    def dies(t):  # rank 1 dies halfway through writing its file
        import threading
        if threading.current_thread().name == "sim-rank-1":
            calls["n"] += 1
            if calls["n"] > 3:
                raise OSError("disk died")
        return real(t)
    monkeypatch.setattr(ck, "_bytes", dies)
    with pytest.raises(RankFailedError, match="disk died"):
        train(_run(layout, 4, save=str(tmp_path), resume=str(tmp_path)))
    monkeypatch.setattr(ck, "_bytes", real)
    assert json.loads((tmp_path / "index.json").read_text()) == before  # the index still names the old data
    whole = train(_run(layout, 4))
    resumed = train(_run(layout, 4, resume=str(tmp_path)))
    assert resumed.losses == whole.losses[2:]


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "playground", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def _saved(tmp_path):
    d = tmp_path / "ck"
    p = _cli("train", "--dp", "2", "--zero", "1", "--steps", "2", "--no-progress", "--save", str(d))
    assert p.returncode == 0, p.stderr
    return d


def _spoil(d, how):
    index = json.loads((d / "index.json").read_text())
    data = d / index["data"]
    if how == "truncated":
        f = data / "rank1.bin"
        f.write_bytes(f.read_bytes()[:-10])
        return "rank1.bin", "truncated or replaced"
    if how == "missing":
        (data / "rank0.bin").unlink()
        return "rank0.bin", "missing"
    if how == "version":
        index["version"] = 99
        (d / "index.json").write_text(json.dumps(index))
        return "index.json", "format version 99"
    if how == "mismatch":
        index["pieces"][-1]["offset"] += 10**6
        (d / "index.json").write_text(json.dumps(index))
        return "index.json", "the index does not match its files"
    raise ValueError(how)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "missing", "version", "mismatch"])
def test_a_bad_checkpoint_is_refused_in_one_line(how, tmp_path):
    d = _saved(tmp_path)
    file, message = _spoil(d, how)
    p = _cli("train", "--dp", "2", "--steps", "3", "--no-progress", "--resume", str(d))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr and file in p.stderr, p.stderr


@pytest.mark.slow
def test_another_model_and_an_occupied_folder_are_refused(tmp_path):
    d = _saved(tmp_path)
    p = _cli("train", "--model", "small", "--steps", "1", "--no-progress", "--resume", str(d))
    assert p.returncode == 2 and "a checkpoint of another model (vocab_size 64 != 256" in p.stderr
    stamp = (d / "index.json").read_text()
    p = _cli("train", "--steps", "1", "--no-progress", "--save", str(d))
    assert p.returncode == 2 and "holds a checkpoint (step 2); add --overwrite" in p.stderr
    assert (d / "index.json").read_text() == stamp  # nothing overwritten
    p = _cli("train", "--steps", "1", "--no-progress", "--save", str(d), "--overwrite")
    assert p.returncode == 0 and json.loads((d / "index.json").read_text())["step"] == 1


@pytest.mark.slow
def test_export_gives_the_reference_state_dict_and_init_from_starts_there(tmp_path):
    d = _saved(tmp_path)
    out = tmp_path / "exported" / "gpt.pt"  # (a folder not there yet: export makes it)
    p = _cli("export", str(d), str(out))
    assert p.returncode == 0, p.stderr
    state = torch.load(out, weights_only=True)
    model = GPT(preset("tiny"))
    model.load_state_dict(state)  # strict: every name and shape
    assert not torch.equal(state["tok_emb.weight"], GPT(preset("tiny")).tok_emb.weight)  # trained, not initial
    run = RunConfig(model=preset("tiny"), layout=Layout(dp=2, tp=2, zero=3), steps=1, lr=0.0, progress=False,
                    init_from=str(out))
    got = _full(train(run, collect=True), "param")
    for n, t in state.items():
        assert torch.equal(got[n], t.double()), n


@pytest.mark.slow
def test_a_checkpoint_written_by_gloo_processes_resumes_on_simulated_ranks(tmp_path):
    whole = train(_run(Layout(dp=2, micro_batch_size=2), 3))
    train(_run(Layout(dp=2, micro_batch_size=2), 2, save=str(tmp_path), backend="gloo"))
    resumed = train(_run(Layout(dp=2, micro_batch_size=2), 3, resume=str(tmp_path)))
    assert resumed.losses == whole.losses[2:]
    assert sorted(os.listdir(tmp_path)) == ["index.json", "step000002"]


def test_steps_is_the_runs_total_and_relaunching_a_finished_run_says_so(tmp_path, cli):
    """Relaunching the same command after a crash finishes the same run: the resumed run
    stops at --steps; a checkpoint already at --steps leaves nothing to run, in one line."""
    layout = Layout(dp=2, micro_batch_size=2)
    train(_run(layout, 2, save=str(tmp_path), save_every=1))
    resumed = train(_run(layout, 3, resume=str(tmp_path)))
    assert resumed.start == 2 and len(resumed.losses) == 1
    from playground.checkpoint import CheckpointError
    with pytest.raises(CheckpointError, match=r"at step 2, and --steps 2 is the run's total: nothing left to run"):
        train(_run(layout, 2, resume=str(tmp_path)))
    status, _, err = cli("train", "--model-config", "vocab_size=61", "--dp", "2", "--micro-batch-size", "2",
                         "--steps", "2", "--no-progress", "--dtype", "float64", "--resume", tmp_path)
    assert status == 2 and err.count("\n") == 1 and "nothing left to run" in err, err


@pytest.mark.slow
def test_each_checkpoint_written_is_one_line(tmp_path):
    p = _cli("train", "--dp", "2", "--steps", "3", "--save-every", "1", "--save", str(tmp_path / "ck"))
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.startswith("checkpoint:")]
    assert [x.split(" saved")[0] for x in lines] == [f"checkpoint: step {k}" for k in (1, 2, 3)], p.stderr
    assert all(str(tmp_path / "ck") in x and "MiB" in x for x in lines)


def test_a_resume_that_changes_the_global_batch_says_so(tmp_path, capsys):
    train(_run(Layout(dp=4, micro_batch_size=2), 1, save=str(tmp_path)))
    capsys.readouterr()
    train(_run(Layout(dp=2, micro_batch_size=2), 2, resume=str(tmp_path)))
    err = capsys.readouterr().err
    assert "a global batch of 4 sequences (dp 2 × 1 microbatches × 2) where the saved run took 8" in err
    assert "--microbatches 2" in err  # what keeps the run the same
    train(_run(Layout(dp=2, microbatches=2, micro_batch_size=2), 2, resume=str(tmp_path)))
    assert "global batch" not in capsys.readouterr().err


def test_resume_and_init_from_together_are_refused(tmp_path, cli):
    with pytest.raises(ValueError, match="give one of them"):
        RunConfig(resume=str(tmp_path), init_from=str(tmp_path / "x.pt"))
    train(_run(Layout(dp=2, micro_batch_size=2), 1, "float32", model=preset("tiny"), save=str(tmp_path)))
    status, _, err = cli("train", "--steps", "3", "--resume", tmp_path, "--init-from", tmp_path / "x.pt")
    assert status == 2 and err.count("\n") == 1 and "give one of them" in err, err


def test_the_fp16_loss_scalers_state_is_resumed(tmp_path, monkeypatch):
    """float16 under ZeRO: the scale doubles every good step here (growth interval 1), so a
    resumed run that dropped the scaler's state would train at another scale and count other
    good steps; resumed, losses, weights and the scaler equal the uninterrupted run's."""
    import zero.loss_scaler as ls
    real = ls.DynamicLossScaler.__init__
    monkeypatch.setattr(ls.DynamicLossScaler, "__init__",
                        lambda self, init_scale=2.0 ** 8, **kw: real(self, init_scale, growth_interval=1))
    layout = Layout(dp=2, zero=1, micro_batch_size=2)
    whole = train(_run(layout, 4, "float16", save=str(tmp_path / "whole")), collect=True)
    train(_run(layout, 2, "float16", save=str(tmp_path / "part")))
    resumed = train(_run(layout, 4, "float16", save=str(tmp_path / "part"), resume=str(tmp_path / "part")),
                    collect=True)
    assert resumed.losses == whole.losses[2:]
    a, b = _full(whole, "param"), _full(resumed, "param")
    assert all(torch.equal(a[n], b[n]) for n in a)
    scalers = [json.loads((tmp_path / d / "index.json").read_text())["scalers"] for d in ("whole", "part")]
    assert scalers[0] == scalers[1] and scalers[0][0]["good_steps"] == 4 and scalers[0][0]["scale"] == 2.0 ** 12


@pytest.mark.parametrize("name,layout,dtype", [
    ("ddp, a NaN skipped", Layout(dp=2, micro_batch_size=2), "float64"),
    ("zero3, a NaN skipped", Layout(dp=2, zero=3, micro_batch_size=2), "float64"),
    ("zero1 fp16, an overflow skipped", Layout(dp=2, zero=1, micro_batch_size=2), "float16")])
def test_resuming_after_a_skipped_step_is_bit_identical(name, layout, dtype, tmp_path, monkeypatch):
    """A skipped step (--on-nan skip, or an fp16 overflow: a loss scale of 2^40 overflows at
    once) leaves AdamW one update behind the step: the checkpoint keeps its own count, so
    that the resumed bias correction is the uninterrupted run's."""
    from playground.faults import Fault
    if dtype == "float16":
        import zero.loss_scaler as ls
        real = ls.DynamicLossScaler.__init__
        monkeypatch.setattr(ls.DynamicLossScaler, "__init__", lambda self, init_scale=2.0 ** 40, **kw: real(self, init_scale))
        kw = {}
    else:
        kw = {"faults": (Fault("nan", 2, 0),), "on_nan": "skip"}
    whole = train(_run(layout, 5, dtype, **kw), collect=True)
    assert whole.values[0]["skipped_steps"] == ([] if dtype == "float16" else [2])
    train(_run(layout, 3, dtype, save=str(tmp_path), **kw))
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["step"] == 3 and index["optimizer_steps"] < 3, index["optimizer_steps"]
    resumed = train(_run(layout, 5, dtype, resume=str(tmp_path)), collect=True)
    assert resumed.losses == whole.losses[3:]
    for step in (3, 4):
        for what in ("param", "exp_avg", "exp_avg_sq"):
            a, b = _full(whole, what, step), _full(resumed, what, step)
            assert all(torch.equal(a[n], b[n]) for n in a), (step, what)


# -- resharding, element by element ------------------------------------------------------------------
KIND_OFFSET = {"param": 0, "exp_avg": 100_000, "exp_avg_sq": 200_000}
RESHARD_CFG = preset("tiny", vocab_size=61)  # (61: the vocabulary is padded for tp 2)


def _numbered(kind: str, pl):
    """The full tensor of `pl.name` whose every element holds its own flat index (plus the kind's offset)."""
    n = int(torch.Size(pl.shape).numel())
    return (torch.arange(n, dtype=torch.float64) + KIND_OFFSET[kind]).view(pl.shape)


def _layout(name: str) -> Layout:
    """'dp3-tp2-zero1' -> Layout(dp=3, tp=2, zero=1)."""
    axes = {k: int(v) for k, v in (((p.rstrip("0123456789"), p[len(p.rstrip("0123456789")):]) for p in name.split("-")))}
    return Layout(micro_batch_size=1, microbatches=axes.get("pp", 1), **axes)


def _build(world, layout):
    from playground.parallelize import parallelize
    run = RunConfig(model=RESHARD_CFG, layout=layout, dtype="float64", progress=False)
    return run, parallelize(GPT(RESHARD_CFG, dtype=torch.float64, device="meta"), layout.mesh(world),
                            run, "cpu")


def _save_numbered(world, layout, folder):
    from playground import checkpoint
    run, model = _build(world, layout)
    model.load_state(lambda kind, pl: pl.local(_numbered(kind, pl)), 1)  # weights and moments: their own indices
    checkpoint.save(world, model, folder, 1, checkpoint.metadata(run, model))


def _load_and_compare(world, layout, folder):
    """Every local weight and moment after loading, against the numbered tensor it is a piece of."""
    from playground import checkpoint
    _, model = _build(world, layout)
    checkpoint.load(model, folder, checkpoint.read_index(folder, RESHARD_CFG))
    wrong = []
    for kind, pl, t in model.state_pieces():
        want = pl.local(_numbered(kind, pl)).to(t.dtype)
        if not torch.equal(t.detach().cpu(), want):
            bad = (t.detach().cpu() != want).nonzero()[0].tolist()
            wrong.append(f"{kind} {pl.name} {pl}: at local index {bad}")
    return wrong


def _saved_numbered(name, root):
    from collectives import launch
    folder = root / name
    if not (folder / "index.json").exists():
        launch(_save_numbered, _layout(name).world, args=(_layout(name), str(folder)))
    return folder


def _covered_once(folder):
    """Every element of every tensor and kind, in the checkpoint's pieces, exactly once."""
    from model.placement import placement_from_dict
    index = json.loads((folder / "index.json").read_text())
    counts = {}
    for p in index["pieces"]:
        pl = placement_from_dict(p["placement"])
        seen = counts.setdefault((p["kind"], pl.name), torch.zeros(int(torch.Size(pl.shape).numel()), dtype=torch.int64))
        idx = pl.index().reshape(-1)
        seen.index_add_(0, idx[idx >= 0], torch.ones(int((idx >= 0).sum()), dtype=torch.int64))
    names = [n for n, _ in GPT(RESHARD_CFG, device="meta").named_parameters()]
    assert set(counts) == {(k, n) for k in KIND_OFFSET for n in names}
    return {key: (int((c == 0).sum()), int((c > 1).sum())) for key, c in counts.items() if not (c == 1).all()}


def _reshard(a, b, root):
    from collectives import launch
    folder = _saved_numbered(a, root)
    assert _covered_once(folder) == {}, (a, _covered_once(folder))
    wrong = [w for ws in launch(_load_and_compare, _layout(b).world, args=(_layout(b), str(folder))).values for w in ws]
    assert not wrong, (a, b, wrong[:3])


# ZeRO sizes and TP degrees (and a pipeline), each saved once; the pairs named in the comments
# once loaded an element as 0 (a flat range's stop read as inclusive) or one element late (a flat
# range of a TP slice starting after its place)
SHARDINGS = ["dp1", "dp3-zero1", "dp5-zero1", "dp4-zero3", "dp2-tp2-zero2", "dp3-tp2-zero1", "dp6-tp2-zero1",
             "dp6-tp2-zero3", "tp2", "pp2-dp2-zero1", "dp6-dp_replicate2-zero3", "dp4-dp_replicate2-tp2-zero1"]
PAIRS = [("dp3-zero1", "dp5-zero1"), ("dp5-zero1", "dp3-zero1"), ("dp3-tp2-zero1", "dp6-tp2-zero3"),
         ("dp6-tp2-zero1", "dp3-tp2-zero1"), ("dp6-dp_replicate2-zero3", "dp4-dp_replicate2-tp2-zero1"),
         ("dp4-zero3", "dp2-tp2-zero2"), ("pp2-dp2-zero1", "dp6-tp2-zero1")]


@pytest.mark.parametrize("a,b", [pair if i < 5 else pytest.param(*pair, marks=pytest.mark.slow)
                                 for i, pair in enumerate(PAIRS)], ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resharding_loads_every_element_from_its_own_place(a, b, tmp_path):
    _reshard(a, b, tmp_path)


@pytest.mark.slow
def test_resharding_between_every_pair_of_shardings(tmp_path):
    for a in SHARDINGS:
        for b in SHARDINGS:
            _reshard(a, b, tmp_path)


def _resume_sweep(n: int, seed: str, reshard: bool = False):
    from benchmarks.resume_sweep import one
    rows = [one(i, seed, reshard=reshard) for i in range(n)]
    differ = [(r["config"], r["stopped_at"], r["resumed_in"], r["differences"]) for r in rows if r["same"] is False]
    assert not differ, differ
    assert sum(r["same"] is True for r in rows) >= n - 1  # (a configuration with no other layout is left out)


def test_a_sample_of_the_random_resume_sweep_is_bit_identical():
    """benchmarks/resume_sweep.py's random configurations (check_sweep's draws), each stopped
    at a random step with a checkpoint and resumed: the same run, bit for bit (its losses,
    gradients, weights, moments, MoE counts and bias, loss scale, AdamW's count); resumed in
    another layout drawn at random, every byte of the state arrives. The whole sweeps in the
    slow tier."""
    _resume_sweep(2, "suite")
    _resume_sweep(2, "suite", reshard=True)


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [False, True])
def test_the_random_resume_sweep_is_bit_identical(reshard):
    _resume_sweep(30, "slow", reshard)


@pytest.mark.sabotage
@pytest.mark.parametrize("reshard", [False, True])
def test_the_resume_sweep_finds_a_resume_that_miscounts_adamws_steps(reshard, monkeypatch):
    """A resume that gives AdamW one update too many (its bias correction then off) is not
    the same run: the sweep's comparison can fail, in the same layout and in another."""
    import playground.checkpoint as ck
    real = ck.load
    monkeypatch.setattr(ck, "load", lambda model, directory, index: real(
        model, directory, {**index, "optimizer_steps": index.get("optimizer_steps", index["step"]) + 1}))
    from benchmarks.resume_sweep import one
    assert one(0, "suite", reshard=reshard)["same"] is False


@pytest.mark.sabotage
def test_the_resume_sweep_finds_a_reshard_that_loads_a_moment_from_the_wrong_place(monkeypatch):
    """Resharding that reads each piece of the first moment in reverse order: the state the
    other layout loads is not the state saved."""
    import playground.checkpoint as ck
    real = ck.Reader.fill

    def fill(self, kind, pl):
        t = real(self, kind, pl)
        return t.flatten().flip(0).reshape(t.shape) if kind == "exp_avg" else t
    monkeypatch.setattr(ck.Reader, "fill", fill)
    from benchmarks.resume_sweep import one
    row = one(0, "suite", reshard=True)
    assert row["same"] is False and any("exp_avg" in d for d in row["differences"])
