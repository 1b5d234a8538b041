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


def _full(res, key):
    full, problems = assemble([v[key] for v in res.values])
    assert not problems, problems
    return full


def _resumed(a, b, tmp_path, k=2, m=2, dtype="float64", model=CFG):
    """(uninterrupted k + m steps in layout a, k steps in a saved then m resumed in b)."""
    whole = train(_run(a, k + m, dtype, model), collect=True, grads_at=k)
    train(_run(a, k, dtype, model, save=str(tmp_path)))
    resumed = train(_run(b, m, dtype, model, resume=str(tmp_path)), collect=True)
    return whole, resumed


SAME_LAYOUT = {
    "ddp": (Layout(dp=2, microbatches=2, micro_batch_size=2), CFG),
    "zero3": (Layout(dp=3, zero=3, micro_batch_size=2), CFG),
    "tp2-sp": (Layout(tp=2, sequence_parallel=True, micro_batch_size=2), CFG),
    "pp2-1f1b": (Layout(pp=2, microbatches=3, micro_batch_size=1), CFG),
    "cp2": (Layout(cp=2, dp=2, micro_batch_size=2), CFG),
    "ep2": (Layout(dp=2, ep=2, micro_batch_size=2), MOE),
}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(SAME_LAYOUT))
def test_resuming_on_the_same_layout_is_bit_identical(name, dtype, tmp_path):
    layout, model = SAME_LAYOUT[name]
    whole, resumed = _resumed(layout, layout, tmp_path, dtype=dtype, model=model)
    assert resumed.start == 2 and resumed.losses == whole.losses[2:]  # every loss, to the bit
    for key in ("grads", "weights"):
        a, b = _full(whole, key), _full(resumed, key)
        assert a.keys() == b.keys()
        for n in a:
            assert torch.equal(a[n], b[n]), (key, n)


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


@pytest.mark.parametrize("name,a,b", RESHARD, ids=[r[0] for r in RESHARD])
def test_resuming_in_another_layout_matches_the_uninterrupted_run(name, a, b, tmp_path):
    if _batch(a) != _batch(b):  # the same global batch on both sides: b takes a's batch by microbatches
        b = Layout(**{**b.__dict__, "microbatches": _batch(a) // (b.dp * b.micro_batch_size)})
    whole, resumed = _resumed(a, b, tmp_path)
    for x, y in zip(whole.losses[2:], resumed.losses):
        assert abs(x - y) <= 1e-10 * abs(x)
    for key in ("grads", "weights"):
        ref, got = _full(whole, key), _full(resumed, key)
        for n in ref:
            scale = ref[n].abs().max().item() or 1.0
            assert (ref[n] - got[n]).abs().max().item() <= 1e-10 * scale, (key, n)


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
        train(_run(layout, 2, save=str(tmp_path), resume=str(tmp_path)))
    monkeypatch.setattr(ck, "_bytes", real)
    assert json.loads((tmp_path / "index.json").read_text()) == before  # the index still names the old data
    whole = train(_run(layout, 4))
    resumed = train(_run(layout, 2, resume=str(tmp_path)))
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


@pytest.mark.parametrize("how", ["truncated", "missing", "version", "mismatch"])
def test_a_bad_checkpoint_is_refused_in_one_line(how, tmp_path):
    d = _saved(tmp_path)
    file, message = _spoil(d, how)
    p = _cli("train", "--dp", "2", "--steps", "1", "--no-progress", "--resume", str(d))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and message in p.stderr and file in p.stderr, p.stderr


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


def test_export_gives_the_reference_state_dict_and_init_from_starts_there(tmp_path):
    d = _saved(tmp_path)
    out = tmp_path / "gpt.pt"
    p = _cli("export", str(d), str(out))
    assert p.returncode == 0, p.stderr
    state = torch.load(out, weights_only=True)
    model = GPT(preset("tiny"))
    model.load_state_dict(state)  # strict: every name and shape
    assert not torch.equal(state["tok_emb.weight"], GPT(preset("tiny")).tok_emb.weight)  # trained, not initial
    run = RunConfig(model=preset("tiny"), layout=Layout(dp=2, tp=2, zero=3), steps=1, lr=0.0, progress=False,
                    init_from=str(out))
    got = _full(train(run, collect=True), "weights")
    for n, t in state.items():
        assert torch.equal(got[n], t.double()), n


def test_a_checkpoint_written_by_gloo_processes_resumes_on_simulated_ranks(tmp_path):
    whole = train(_run(Layout(dp=2, micro_batch_size=2), 3))
    train(_run(Layout(dp=2, micro_batch_size=2), 2, save=str(tmp_path), backend="gloo"))
    resumed = train(_run(Layout(dp=2, micro_batch_size=2), 1, resume=str(tmp_path)))
    assert resumed.losses == whole.losses[2:]
    assert sorted(os.listdir(tmp_path)) == ["index.json", "step000002"]
