"""Attention dropout (model/dropout.py): the masks, their replay under activation
checkpointing, their per-rank generators, how the simulator prices and counts them, and
the refusals."""
import contextlib
import subprocess
import sys

import pytest
import torch

from activation_checkpointing import checkpoint as ac
from activation_checkpointing.checkpoint import checkpoint_blocks
from model import GPT, assemble, preset
from model.dropout import dropout
from playground import Layout, RunConfig
from playground.equivalence import check
from playground.layout import LayoutError
from playground.training import train
from simulator.clock import RankClock
from simulator.compute_model import ComputeModel
from simulator.hardware import load_hardware
from simulator.memory import MemoryTracker


def test_dropout_zeroes_a_fraction_and_scales_the_rest_and_its_gradient():
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(200, 500, dtype=torch.float64) + 1).requires_grad_()
    y = dropout(x, 0.3, g)
    kept = y != 0
    assert abs(1 - kept.double().mean().item() - 0.3) < 0.01
    assert torch.allclose(y[kept], x[kept] / 0.7, rtol=1e-15)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, kept.double() / 0.7)
    assert dropout(x, 0.3, g, training=False) is x and dropout(x, 0.0, g) is x
    # the generator decides the mask
    a = dropout(x, 0.3, torch.Generator().manual_seed(5))
    b = dropout(x, 0.3, torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and not torch.equal(a, y)


def _loss_and_grads(cfg, ac_mode, x):
    model = GPT(cfg, seed=1, dtype=torch.float64)
    if ac_mode != "none":
        checkpoint_blocks(model, ac_mode)
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_replays_the_forwards_masks(mode, monkeypatch):
    """Activation checkpointing recomputes each block with the masks its forward drew: loss
    and every gradient equal to the run without checkpointing (float64). Without the
    replay of the generators' states the gradients differ (the sabotage below)."""
    cfg = preset("tiny", attention="unfused", attention_dropout=0.3)
    x = torch.randint(0, 64, (2, 33))
    la, ga = _loss_and_grads(cfg, "none", x)
    lb, gb = _loss_and_grads(cfg, mode, x)
    assert torch.equal(la, lb)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(ga, gb))
    _, g0 = _loss_and_grads(preset("tiny", attention="unfused"), "none", x)
    assert not torch.allclose(ga[3], g0[3])  # the masks changed something

    monkeypatch.setattr(ac, "_replaying", lambda rng: contextlib.nullcontext())
    _, gc = _loss_and_grads(cfg, mode, x)
    assert not all(torch.allclose(a, b, rtol=1e-6) for a, b in zip(ga, gc))


def test_a_layout_with_dropout_trains_reproducibly_with_per_rank_masks():
    """tp 2 × pp 2 with full checkpointing: every rank draws from its own generator, and the
    same run gives the same losses twice; the losses differ from the run without dropout."""
    def losses(rate):
        cfg = preset("tiny", attention="unfused", attention_dropout=rate)
        run = RunConfig(model=cfg, layout=Layout(tp=2, pp=2, micro_batch_size=2, microbatches=2, ac="full"),
                        steps=3, progress=False)
        return train(run).losses
    a, b, none = losses(0.2), losses(0.2), losses(0.0)
    assert a == b and a != none
    assert all(abs(x - y) < 0.2 for x, y in zip(a, none))


def _pipeline(ac_mode):
    cfg = preset("tiny", attention="unfused", attention_dropout=0.2)
    run = RunConfig(model=cfg, layout=Layout(pp=2, microbatches=4, micro_batch_size=1, ac=ac_mode), steps=2,
                    dtype="float64", progress=False)
    res = train(run, collect=True)
    return res.losses, {k: assemble(res.pieces(k, step))[0] for k, step in (("grads", 0), ("param", None))}


def test_a_pipeline_recomputes_each_microbatch_with_its_own_masks():
    """1F1B with pp 2 and 4 microbatches: a stage runs a second microbatch's forward before
    recomputing the first's, so each recomputation must restore its own forward's generator
    state and then give back the later one; with full checkpointing every loss, gradient and
    weight is bitwise the run's without. Without the replay they differ (so the test can fail)."""
    plain, full = _pipeline("none"), _pipeline("full")
    assert plain[0] == full[0]
    for key in ("grads", "param"):
        assert all(torch.equal(plain[1][key][n], full[1][key][n]) for n in plain[1][key]), key


def test_a_pipeline_without_the_replay_draws_other_masks(monkeypatch):
    plain = _pipeline("none")
    monkeypatch.setattr(ac, "_replaying", lambda rng: contextlib.nullcontext())
    full = _pipeline("full")
    assert not all(torch.equal(plain[1]["grads"][n], full[1]["grads"][n]) for n in plain[1]["grads"])


def test_the_simulator_prices_dropout_as_torchs_fused_kernels_and_keeps_a_byte_mask():
    """On meta tensors (a plan): forward one kernel reading the probabilities and writing them
    and a one-byte mask, backward one reading the gradient and the mask and writing one;
    the mask is what backward keeps."""
    x = torch.empty(2, 4, 64, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    compute, tracker = ComputeModel(load_hardware("h100-sxm"), RankClock()), MemoryTracker()
    compute.by_op = {}
    with compute, tracker.track_activations():
        y = dropout(x, 0.1, None)
        assert tracker.activations == x.numel()
        y.backward(torch.empty_like(y))
    n = x.numel()
    assert compute.by_op["native_dropout"][0] == 1 and compute.by_op["native_dropout"][2] == 2 * 2 * n + n
    assert compute.by_op["native_dropout_backward"][0] == 1
    assert compute.by_op["native_dropout_backward"][2] == 2 * 2 * n + n
    assert compute.kernels == 2


def test_dropout_refusals_name_the_values():
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 needs attention='unfused'"):
        preset("tiny", attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"attention_dropout=1.0 must be in \[0, 1\)"):
        preset("tiny", attention="unfused", attention_dropout=1.0)
    cfg = preset("tiny", attention="unfused", attention_dropout=0.1)
    with pytest.raises(ValueError, match="check needs attention_dropout=0, not 0.1"):
        check(RunConfig(model=cfg, layout=Layout(dp=2), steps=1, progress=False))
    with pytest.raises(LayoutError, match="cp=2 needs attention='flash'"):
        Layout(cp=2).validate(cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's fused CUDA dropout draws from the device's generator")
@pytest.mark.parametrize("compiled", [False, True])
def test_on_cuda_recomputation_replays_the_device_generators_masks(compiled):
    """On CUDA (torch's fused dropout kernel, eager or compiled per block): full and selective
    checkpointing (full only when compiled: RunConfig refuses --compile with selective) give
    the loss and gradients of the run without it, and dropout changed them. Run by
    benchmarks/fidelity_gpu.sh's `dropout` set (CI has no GPU)."""
    from playground.parallelize import compile_blocks
    x = torch.randint(0, 64, (2, 33), device="cuda")

    def run(rate, mode):
        cfg = preset("tiny", attention="unfused", attention_dropout=rate)
        model = GPT(cfg, seed=1, device="cuda")
        if mode != "none":
            checkpoint_blocks(model, mode)
        if compiled:
            compile_blocks(model)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]
    la, ga = run(0.3, "none")
    for mode in ("full",) if compiled else ("full", "selective"):
        lb, gb = run(0.3, mode)
        assert torch.allclose(la, lb, rtol=1e-6)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(ga, gb)), mode
    l0, _ = run(0.0, "none")
    assert not torch.allclose(la, l0, rtol=1e-6)


@pytest.mark.slow
def test_the_command_line_refuses_dropout_where_it_cannot_run_in_one_line():
    for args, words in ((["check", "--model-config", "attention=unfused,attention_dropout=0.1", "--dp", "2"],
                         "check needs attention_dropout=0, not 0.1"),
                        (["train", "--model-config", "attention_dropout=0.1"], "needs attention='unfused'"),
                        (["train", "--model-config", "attention=unfused", "--cp", "2"], "cp=2 needs attention='flash'")):
        r = subprocess.run([sys.executable, "-m", "playground", *args, "--model", "tiny"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
