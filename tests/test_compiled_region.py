"""A compiled region on the meta device (model/compiled.py, `partitioned`): what a plan
counts and prices for a region a GPU runs through torch.compile, whose backward AOTAutograd
compiles too. Its forward keeps for backward what the min-cut partition saves, not what an
eager autograd graph would (the GPU's own count: benchmarks/region_memory_gpu.py); what the
backward recomputes costs neither bytes nor memory (Inductor fuses it into its consumers);
on the CPU the region is the function, op by op."""
import faulthandler
import os
import threading

import pytest
import torch
import torch.nn.functional as F

from model.compiled import partitioned, region
from simulator import MemoryTracker


def _swiglu(x, w1, w2):
    return F.silu(x @ w1) * (x @ w2)


def _meta(*shape, grad=True):
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta", requires_grad=grad)


def _kept(run):
    """Bytes the tracker counts as activations after run() (its output kept)."""
    tracker = MemoryTracker()
    with tracker.track_activations():
        out = run()
        held = tracker.activations
    del out
    return held


def _check_swiglu_keeps_its_partition():
    x, w1, w2 = _meta(512, 64), _meta(64, 256), _meta(64, 256)
    h = 512 * 256 * 2
    eager = _kept(lambda: _swiglu(x, w1, w2))
    kept = _kept(lambda: region("swiglu", 0, _swiglu, x, w1, w2))
    assert eager == x.nbytes + 3 * h + 2 * (64 * 256 * 2)  # (the weights: no parameters excluded here)
    assert kept == eager - h, f"the region kept {kept:,} bytes, its partition saves {eager - h:,}"


def test_a_region_keeps_what_its_partition_saves():
    """SwiGLU's eager graph keeps x, both products and silu's output; the partition keeps x
    and the two products and recomputes silu in backward: one (T, f) tensor less."""
    _check_swiglu_keeps_its_partition()


def test_its_gradients_and_outputs_keep_their_shapes_and_structure():
    def pair(x, w):
        y = x @ w
        return y, (y.sum(), 3)
    x, w = _meta(8, 4), _meta(4, 2)
    y, (s, three) = partitioned(pair, "pair", x, w)
    assert y.shape == (8, 2) and s.shape == () and three == 3
    gx, gw = torch.autograd.grad((y.sum() + s), (x, w))
    assert gx.shape == x.shape and gw.shape == w.shape


@pytest.mark.parametrize("policy", [None, "selective"])
def test_a_region_in_a_checkpointed_block_runs_as_its_partition_again_in_the_recomputation(policy, monkeypatch):
    """Inside an activation-checkpointed block a GPU runs the compiled region in the forward,
    again in the recomputation, and its compiled backward: a plan runs the partition there too
    (the eager graph's backward it priced before was 8% shorter than the compiled one's on
    1b-moe under full recomputation), under torch's checkpoint and the selective policy."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

    from activation_checkpointing.policy import SelectivePolicy
    from model import compiled

    ran = []
    forward = compiled._Partitioned.forward

    def counted(ctx, graphs, *tensors):
        ran.append(graphs.name)
        return forward(ctx, graphs, *tensors)
    monkeypatch.setattr(compiled._Partitioned, "forward", staticmethod(counted))
    x, w1, w2 = _meta(512, 64), _meta(64, 256), _meta(64, 256)
    context = noop_context_fn if policy is None else (
        lambda: create_selective_checkpoint_contexts(SelectivePolicy()))
    out = checkpoint(lambda a: region("swiglu", 0, _swiglu, a, w1, w2, checkpointed=True).sum(), x,
                     use_reentrant=False, context_fn=context)
    gx, gw1 = torch.autograd.grad(out, (x, w1))
    assert ran == ["swiglu", "swiglu"]  # (the forward, then the recomputation)
    assert gx.shape == x.shape and gw1.shape == w1.shape


def test_a_region_is_traced_once_on_the_tracers_thread():
    """Ranks run in threads; a region's trace is made on the tracer's thread, once for all."""
    traced_on = []

    def swiglu(x, w1, w2):  # (called only while tracing: the graphs run after)
        traced_on.append(threading.current_thread().name)
        return _swiglu(x, w1, w2)
    x, w1, w2 = _meta(64, 32), _meta(32, 48), _meta(32, 48)

    def ranks():
        threads = [threading.Thread(target=lambda: partitioned(swiglu, "threads", x, w1, w2)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ranks()
    traces = len(traced_on)  # (AOTAutograd calls the function more than once in one trace)
    assert traces and all(name.startswith("region-tracer") for name in traced_on)
    ranks()
    assert len(traced_on) == traces


@pytest.mark.sabotage
def test_a_region_that_saves_past_the_hooks_leaves_its_bytes_uncounted(saves_past_the_hooks):
    """Sabotage: a region that keeps its saved tensors on its node instead of through
    save_for_backward (as AOTAutograd's own runtime does for some) holds them unseen."""
    with pytest.raises(AssertionError, match="the region kept"):
        _check_swiglu_keeps_its_partition()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX's")
def test_a_forked_process_traces_on_a_tracer_of_its_own():
    """A child forked after the parent traced has the parent's executor but not its thread: it
    gets a tracer of its own instead of waiting forever."""
    x, w1, w2 = _meta(16, 8), _meta(8, 12), _meta(8, 12)
    partitioned(_swiglu, "fork", x, w1, w2)
    pid = os.fork()
    if pid == 0:  # (the child: a new shape, traced; a hang ends it with a failing status)
        faulthandler.dump_traceback_later(60, exit=True)
        try:
            ok = partitioned(_swiglu, "fork", _meta(17, 8), w1, w2).shape == (17, 12)
        except RuntimeError as e:  # (torch's own refusal, where its autograd threads forbid a fork)
            os._exit(3 if "fork" in str(e) else 1)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 3:
        pytest.skip("this torch build refuses autograd in a forked child (its autograd device threads)")
    assert code == 0


@pytest.mark.parametrize("policy", [None, "selective"])
def test_the_recomputation_a_regions_backward_sets_off_is_launched_op_by_op(policy):
    """Where a compiled region's backward is the first to take back a checkpointed block's
    saved tensors, torch's checkpoint recomputes the block then: a GPU launches those ops one
    by one (the region's forward among them, as its own compiled call) before the backward's
    one call. So a plan issues each recomputed op as in the forward, not as kernels of the
    region's backward graph (1b-moe under full recomputation: the host issued no recomputed
    op, 56 ms with and without it, where an H100 launched 816 kernels more a step)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

    from activation_checkpointing.policy import SelectivePolicy
    from simulator.clock import RankClock
    from simulator.compute_model import ComputeModel
    from simulator.hardware import load_hardware

    x, w1, w2 = _meta(512, 64), _meta(64, 256), _meta(64, 256)
    context = noop_context_fn if policy is None else (
        lambda: create_selective_checkpoint_contexts(SelectivePolicy()))
    compute = ComputeModel(load_hardware("h100-sxm"), RankClock())
    compute.by_op = {}
    with compute:  # (the block: a scaling, then the region; sum's backward takes back no tensor)
        out = checkpoint(lambda a: region("swiglu", 0, _swiglu, torch.sigmoid(a), w1, w2, checkpointed=True).sum(),
                         x, use_reentrant=False, context_fn=context)
        torch.autograd.grad(out, (x, w1))
    launched = {name: row[0] for name, row in compute.by_op.items()}
    assert launched.get("sigmoid") == 2, launched  # (the forward's, the recomputation's)
    assert launched.get("swiglu") == 2, launched  # (the region's forward as one call, twice)
    assert launched.get("swiglu_backward") == 1, launched


def _exp_line(x):
    return (x * 2 + 1).exp()


@pytest.mark.parametrize("region_op_floor", [None, 1.0])
def test_a_regions_calls_cost_the_host_its_graphs_ops_where_the_profile_prices_them(region_op_floor):
    """(2x + 1).exp() as a region: its forward graph launches three ops (mul, add, exp), its
    backward two (the output gradient times the saved exp, times 2). At `region_op_floor` a
    second an op its calls cost the host 3 s and 2 s whatever the kernel floor; without one,
    one kernel floor each (a compiled call, however many kernels it launches)."""
    import dataclasses

    from simulator.clock import RankClock
    from simulator.compute_model import ComputeModel
    from simulator.hardware import load_hardware

    floor = 1000.0
    hw = dataclasses.replace(load_hardware("h100-sxm"), kernel_floor=floor, region_op_floor=region_op_floor)
    compute = ComputeModel(hw, RankClock())
    x = torch.empty(64, 64, device="meta", requires_grad=True)
    with compute:
        y = region("exp_line", 0, _exp_line, x)
        forward = compute.clock.issuing
        grad = torch.ones_like(y)
        before = compute.clock.issuing
        torch.autograd.grad(y, x, grad)
        backward = compute.clock.issuing - before
    assert (forward, backward) == ((floor, floor) if region_op_floor is None else (3.0, 2.0))


def test_the_region_timer_times_a_call_and_the_backward_node_below_its_views():
    """RegionTimer.timed: the host's time in the call, and from its node's start to its end in
    the backward, found below a view of the output."""
    import time

    from model.region_timer import RegionTimer, backward_node

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(0.02)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.04)
            return g * 2

    timer = RegionTimer()
    x = torch.ones(4, requires_grad=True)
    y = timer.timed("slow", lambda: Slow.apply(x).view(2, 2))
    assert backward_node(y).name() == "SlowBackward"
    y.sum().backward()
    (name, way, fwd), (_, way_back, bwd) = timer.calls
    assert (name, way, way_back) == ("slow", "forward", "backward") and 0.02 <= fwd < 0.04 <= bwd < 0.1
    assert timer.seconds == pytest.approx(fwd + bwd) and torch.equal(x.grad, torch.full((4,), 2.0))
