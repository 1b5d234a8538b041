"""Memory accounting by category: model states exactly what the tensors
hold, activations as autograd saves and frees them, per rank thread."""
import pytest
import torch

from collectives import launch
from simulator.memory import MemoryTracker
from model import GPT, preset
from playground import Layout, RunConfig
from playground.training import train


def test_model_states_are_exact_in_a_ddp_run():
    cfg = preset("tiny")
    res = train(RunConfig(model=cfg, layout=Layout(dp=3, micro_batch_size=2), steps=2, progress=False,
                          hardware="h100-sxm", bucket_cap_mb=0.02))
    n, tensors = cfg.n_params(), len(list(GPT(cfg, device="meta").parameters()))
    for v in res.values:
        m = v["memory"]
        assert m["parameters"] == 4 * n
        assert m["gradients"] == 4 * n  # the DDP buckets, which the gradients are views of
        assert m["optimizer"] == 2 * 4 * n + 4 * tensors  # AdamW: exp_avg, exp_avg_sq, a float32 step each
        assert m["activations"] == 0 < m["peak_activations"]
        states = m["parameters"] + m["gradients"] + m["optimizer"]  # (+ the peak of what is transient)
        assert states + m["peak_activations"] <= m["peak_total"] <= states + m["peak_activations"] + m["peak_temporaries"]
    assert len({v["memory"]["peak_activations"] for v in res.values}) == 1  # same shapes on every rank


def _peak(world, batch):
    model = GPT(preset("tiny"), seed=0)
    tracker = MemoryTracker()
    x = torch.randint(0, 64, (batch, 33))
    with tracker.track_activations(exclude=list(model.parameters())):
        loss = model(x[:, :-1], x[:, 1:])
        during = tracker.activations
        loss.backward()
        del loss
    return during, tracker.peak_activations, tracker.activations


def test_activations_are_linear_in_the_batch_and_freed_by_backward():
    peaks = {}
    for b in (1, 2, 4):
        res = launch(_peak, 3, args=(b,))  # three rank threads tracking at once
        assert len(set(res.values)) == 1  # each thread saw only its own tensors
        during, peak, after = res.values[0]
        assert during == peak > 0 and after == 0
        peaks[b] = peak
    per_sequence = peaks[2] - peaks[1]
    # linear up to a few hundred bytes (measured 512 of 845 KB: small tensors some kernels
    # save, counted by their storage); the rest is batch-independent (the RoPE tables)
    assert abs((peaks[4] - peaks[2]) - 2 * per_sequence) <= 1e-3 * peaks[4]
    assert 0 < peaks[1] - per_sequence < per_sequence


def test_parameters_saved_for_backward_are_not_activations():
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    tracker = MemoryTracker()
    with tracker.track_activations(exclude=[w]):
        y = x @ w  # saves x and w
        assert tracker.activations == 8 * 64 * 4
        y.sum().backward()


def test_backward_temporaries_are_counted():
    """The cross-entropy's backward holds two float64 tensors of the logits' size at once
    (nll_loss's gradient, then log_softmax's): the peak of backward's temporaries; what is
    left when backward is done is x's gradient (x is no parameter) until it is freed, and
    nothing is counted outside backward."""
    tracker = MemoryTracker()
    x = torch.randn(64, 1000, requires_grad=True)
    target = torch.randint(0, 1000, (64,))
    with tracker.track_activations():
        loss = torch.nn.functional.cross_entropy(x.double(), target)
        assert tracker.peak_temporaries == 0 and tracker.activations >= 8 * x.numel()
        loss.backward()
    assert tracker.peak_temporaries == 2 * 8 * x.numel() and tracker.temporaries == 4 * x.numel()
    x.grad = None
    assert tracker.temporaries == 0
    # at that moment log_softmax's saved output (float64) is still held
    assert tracker.peak_transient == tracker.peak_temporaries + 8 * x.numel()


def test_a_fused_region_leaves_only_its_outputs_as_temporaries():
    """Inside a fused region (ops a GPU runs as one kernel: here the backward of Megatron's
    scale-mask-softmax, whose arithmetic runs op by op in float32 on the CPU) the
    intermediate tensors never exist on a GPU: backward's temporaries are the region's
    output alone, the bf16 gradient of the scores (the float32 intermediates are four
    times its size each)."""
    from model.gpt import ScaledCausalSoftmax
    from simulator.compute_model import ComputeModel
    from simulator.clock import RankClock
    from simulator.hardware import load_hardware
    tracker = MemoryTracker()
    scores = torch.randn(2, 4, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    with ComputeModel(load_hardware("h100-sxm"), RankClock()), tracker.track_activations():
        p = ScaledCausalSoftmax.apply(scores, 0.25)
        p.backward(torch.randn_like(p))
    assert tracker.peak_temporaries == scores.numel() * 2 and tracker.temporaries == scores.numel() * 2
    scores.grad = None  # (the region's output lived on as the leaf's gradient: counted until freed)
    assert tracker.temporaries == 0


@pytest.mark.parametrize("zero,dp,replicate", [(0, 3, 1), (1, 3, 1), (2, 3, 1), (3, 3, 1), (3, 4, 2), (1, 6, 2)])
def test_model_states_match_the_one_formula(zero, dp, replicate):
    """What a rank holds after a step (weights, gradients, AdamW's moments), measured on the
    engines, is zero.model_state_bytes over the shard group: the formula the capacity
    estimate and the search both use (up to the flat units' padding and AdamW's step counts)."""
    from zero.rules import model_state_bytes
    cfg = preset("tiny")
    run = RunConfig(model=cfg, layout=Layout(dp=dp, zero=zero, dp_replicate=replicate, micro_batch_size=1),
                    steps=1, dtype="float64", progress=False)
    m = train(run).values[0]["memory"]
    held = m["parameters"] + m["gradients"] + m["optimizer"]
    assert held == pytest.approx(model_state_bytes(cfg.n_params(), zero, dp // replicate, 8), rel=2e-3)
