"""Activation checkpointing (full and selective) on every strategy: the same loss, gradients
and weights as one device without it, in float64; sabotaged recomputations that the check
catches; the activations kept per layer against the block's term-by-term count (and full
checkpointing's 2sbh of Korthikanti et al. 2022); the recomputation charged on the clock."""
import pytest
import torch

import activation_checkpointing.checkpoint as ac
from benchmarks.activation_checkpointing import per_layer, this_block
from model import GPTConfig, preset
from playground import Layout, LayoutError, RunConfig
from playground.equivalence import check

CFG = preset("tiny", vocab_size=61, n_layers=2)
MOE = preset("tiny-moe", vocab_size=61)


def _run(ac_mode, dtype="float64", steps=3, microbatches=2, sp=False, model=CFG, **axes):
    return RunConfig(model=model, layout=Layout(sequence_parallel=sp, microbatches=microbatches, micro_batch_size=2,
                                                ac=ac_mode, **axes), steps=steps, dtype=dtype, progress=False)


LAYOUTS = {
    "one-rank": {},
    "dp2-zero3": dict(dp=2, zero=3),
    "dp3-tp2-sp": dict(dp=3, tp=2, sp=True),
    "pp2-dp2-zero1-interleaved": dict(pp=2, dp=2, zero=1, microbatches=4, schedule="interleaved",
                                      virtual_stages=2, model=preset("tiny", vocab_size=61, n_layers=4)),
    "cp2-ring-dp2": dict(cp=2, dp=2),
    "cp2-ulysses": dict(cp=2, cp_impl="ulysses"),
    "moe-ep2-tp2-sp-zero3": dict(dp=2, ep=2, tp=2, sp=True, zero=3, model=MOE),
}


def _assert_passed(rep):
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
    assert rep.worst("grad").max_rel < 1e-12 and rep.worst("weight").max_rel < 1e-10


# (the default tier: full on one rank, on TP + SP and on an interleaved pipeline; each
# selective mode once; the rest in the slow tier)
@pytest.mark.parametrize("name,mode", [
    pytest.param(n, "full", marks=() if n in ("one-rank", "dp3-tp2-sp", "pp2-dp2-zero1-interleaved")
                 else pytest.mark.slow) for n in LAYOUTS] + [
    pytest.param(n, "selective", marks=() if n == "dp2-zero3" else pytest.mark.slow) for n in LAYOUTS
    if n not in ("one-rank", "cp2-ulysses")] + [
    pytest.param(n, "selective-op", marks=() if n == "dp2-zero3" else pytest.mark.slow)
    for n in ("dp2-zero3", "dp3-tp2-sp", "pp2-dp2-zero1-interleaved", "moe-ep2-tp2-sp-zero3")])
def test_checkpointing_matches_one_device(name, mode):
    _assert_passed(check(_run(mode, **LAYOUTS[name])))


def test_full_checkpointing_with_the_split_backward_of_zb1():
    _assert_passed(check(_run("full", pp=2, dp=2, zero=1, microbatches=4, schedule="zb1")))


def test_selective_checkpointing_in_bfloat16_under_a_pipeline():
    """autocast's cache of weight casts spans the whole schedule: the recomputation must cast
    as many weights as the first forward did (the model turns the cache off)."""
    rep = check(_run("selective", dtype="bfloat16", pp=2, microbatches=4))
    assert rep.passed, rep.problems


# -- sabotage -------------------------------------------------------------------------------------------
def _recompute_from_another_input(monkeypatch):
    call = ac._Region.__call__

    def perturbed(self, *args):
        if self.ran:
            args = (args[0] * (1 + 1e-3),) + args[1:]
        return call(self, *args)
    monkeypatch.setattr(ac._Region, "__call__", perturbed)


def _recompute_without_telling_the_modules(monkeypatch):
    import contextlib
    monkeypatch.setattr(ac, "_recomputing", lambda modules: contextlib.nullcontext())


@pytest.mark.sabotage
@pytest.mark.parametrize("name,sabotage", [("dp3-tp2-sp", _recompute_from_another_input),
                                           ("moe-ep2-tp2-sp-zero3", _recompute_without_telling_the_modules)],
                         ids=["recompute-from-another-input", "recompute-without-telling-the-modules"])
def test_sabotaged_recomputation_fails_the_check(name, sabotage, monkeypatch):
    sabotage(monkeypatch)
    rep = check(_run("full", steps=2, **LAYOUTS[name]))
    assert not rep.passed
    assert rep.problems or rep.worst("loss").max_rel > 1e-6 or rep.worst("grad").max_rel > 1e-6


# -- memory and time --------------------------------------------------------------------------------------
SMALL = GPTConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=176, seq_len=64)


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_activations_per_layer_are_the_blocks_count(tp, sp):
    """Micro-batch 2 (a strided sequence-parallel gather would be copied by each matmul);
    grouped-query attention (k = 1/2)."""
    modes = ("none", "selective", "selective-op", "full")
    got = {mode: per_layer(mode, SMALL, tp, sp, mbs=2, hardware="h100-sxm") for mode in modes}
    for mode, m in got.items():
        assert m["per_sbh"] == pytest.approx(this_block(mode, SMALL, tp, sp), rel=1e-9), mode
    assert got["full"]["per_sbh"] == 2 / (tp if sp else 1)  # the block input only, in bf16 (2sbh)
    # the recomputation is charged: each mode's layer costs more time than keeping more
    assert [got[m]["layer_step_s"] for m in modes] == sorted(got[m]["layer_step_s"] for m in modes)


@pytest.mark.parametrize("mode,recomputed", [("selective", 0), ("selective-op", 3), ("full", 6)])
def test_each_mode_recomputes_its_matmuls(mode, recomputed):
    """A block's seven matmuls (wq, wk, wv, wo, w_gate, w_up, w_down): selective recomputes
    none, torchtitan's selective op every second (wk, wo, w_up), full all but w_down (whose
    output no backward needs: torch's checkpoint stops recomputing once it has what backward
    needs); its backward runs those beside the matmuls of the gradients that a backward
    without checkpointing runs."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    from activation_checkpointing import checkpoint_blocks
    from model import GPT

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket is torch.ops.aten.mm:
                self.shapes[tuple(args[1].shape)] += 1
            return func(*args, **(kwargs or {}))

    def backward_matmuls(ac_mode):
        torch.manual_seed(0)
        m = GPT(preset("tiny", vocab_size=61, n_layers=1), dtype=torch.float64)
        checkpoint_blocks(m, ac_mode)
        loss = m(torch.randint(0, 61, (2, 8))).sum()
        with CountMatmuls() as counted:
            loss.backward()
        return counted.shapes, m.blocks["0"]
    extra = backward_matmuls(mode)[0] - backward_matmuls("none")[0]
    assert sum(extra.values()) == recomputed
    if mode == "selective-op":  # the recomputed ones are the forward's own, x @ wᵀ, of wk, wo and w_up
        b = backward_matmuls("none")[1]
        assert extra == collections.Counter(tuple(w.weight.t().shape) for w in (b.attn.wk, b.attn.wo, b.mlp.w_up))


@pytest.mark.parametrize("every", [None, 2], ids=["selective", "selective-op"])
def test_the_policy_keeps_no_output_an_op_writes_into_a_given_tensor(every):
    """A compiled region inside a checkpointed block (the MoE layer's, model/compiled.py) runs
    Inductor's code, which calls its matmuls with `out=` into buffers it reuses for later
    kernels: kept, such an output is overwritten before the recomputation takes it back, and
    torch's checkpoint refuses the step (1b-moe under --ac selective on an H100). The policy
    keeps only the outputs ops make (here the out-of-place mm)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from activation_checkpointing.policy import SelectivePolicy

    class Compiled(torch.autograd.Function):  # (as Inductor's code: one buffer, two matmuls into it)
        @staticmethod
        def forward(ctx, x, w):
            buf = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype)
            torch.mm(x, w, out=buf)
            y = buf.sin()
            torch.mm(x, 2 * w, out=buf)
            ctx.save_for_backward(x, w)
            return y + buf

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            d = torch.cos(x @ w) * g + 2 * g
            return d @ w.t(), None

    def body(x, w):
        return Compiled.apply(torch.mm(x, w).tanh(), w).sum()

    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, dtype=torch.float64)
    body(x, w).backward()
    expected, x.grad = x.grad, None
    checkpoint(body, x, w, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(SelectivePolicy(every))).backward()
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_bad_ac_values_are_refused_with_the_reason():
    with pytest.raises(LayoutError, match="ac='partial'"):
        Layout(ac="partial").validate(CFG)


def test_selective_checkpointing_with_the_split_backward_of_zb1():
    """ZB-H1's W pass is no second backward through the block (the linear layers defer
    their weight GEMMs), so torch's selective checkpointing, which allows one, takes it."""
    _assert_passed(check(_run("selective", pp=2, microbatches=4, schedule="zb1")))


def test_no_gradients_no_checkpoint():
    """Evaluation (no gradients) runs the blocks plainly."""
    from activation_checkpointing import checkpoint_blocks
    from model import GPT
    m = GPT(CFG, dtype=torch.float64)
    x = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        want = m(x)
        checkpoint_blocks(m, "full")
        assert torch.equal(m(x), want)


# -- compile -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["flash", "unfused"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_blocks_compute_the_same_loss_and_gradients(attention, dtype):
    """The compile transform keeps the numbers (dynamo's graphs run eagerly here: inductor's
    kernels are the GPU's business), with and without full checkpointing, through the
    model's own autograd Functions (RMSNorm's on the CPU, the unfused attention's softmax),
    in the dtypes where their casts are no-ops (model/compiled.py, `as_dtype`)."""
    from activation_checkpointing import checkpoint_blocks
    from model import GPT
    from playground.parallelize import compile_blocks
    cfg = CFG.with_(attention=attention)
    x = torch.randint(0, 61, (2, 17))
    got = {}
    for name, ac_mode, compiled in (("eager", "none", False), ("compiled", "none", True), ("both", "full", True)):
        torch._dynamo.reset()
        m = GPT(cfg, dtype=dtype)
        checkpoint_blocks(m, ac_mode)
        if compiled:
            compile_blocks(m, backend="eager")
        loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        got[name] = (loss.detach(), [(n, p.grad) for n, p in m.named_parameters()])
    for name in ("compiled", "both"):
        assert torch.equal(got[name][0], got["eager"][0])
        # each gradient within a few roundings of its largest element: dynamo's graph may
        # order a sum otherwise (and a BLAS round otherwise on another machine), which moves
        # an element near zero by more than that of itself
        for (n, a), (_, b) in zip(got[name][1], got["eager"][1]):
            assert (a - b).abs().max() <= 1e3 * torch.finfo(dtype).eps * b.abs().max(), (name, n)


@pytest.mark.slow
def test_inductors_compiled_blocks_compute_the_same_in_float64_on_the_cpu():
    """`check --compile` on gloo runs Inductor's CPU kernels: in float64 the flash kernel's
    backward runs outside the graph (model/gpt.py, `_eager_attention`), where torch 2.11's
    and 2.12's Inductor handed it a float32 log-sum-exp and the step raised."""
    from model import GPT
    from playground.parallelize import compile_blocks
    x = torch.randint(0, 61, (2, 17))
    got = []
    for compiled in (False, True):
        torch._dynamo.reset()
        m = GPT(CFG, dtype=torch.float64)
        if compiled:
            compile_blocks(m)
        loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        got.append((loss.detach(), [p.grad for p in m.parameters()]))
    assert (got[1][0] - got[0][0]).abs() <= 64 * torch.finfo(torch.float64).eps * got[0][0].abs()
    for a, b in zip(got[1][1], got[0][1]):
        assert (a - b).abs().max() <= 1e3 * torch.finfo(torch.float64).eps * b.abs().max()


def test_compile_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="--compile.*--backend torch"):
        RunConfig(model=CFG, compile=True)
    with pytest.raises(ValueError, match="--compile with --ac selective"):
        RunConfig(model=CFG, layout=Layout(ac="selective"), compile=True, backend="gloo")


@pytest.mark.parametrize("mode", ["selective", "selective-op", "full"])
def test_a_selective_checkpoint_costs_the_host_its_floor_per_op(mode, monkeypatch):
    """Torch's selective checkpoint runs each op of a block's forward and recomputation
    through a Python dispatch mode (on one H100's host 1b-moe's host-bound step took 197 ms
    under --ac selective, 123 ms under full): a plan charges the profile's `selective_floor`
    for each op there, the kernels it launches and the views it does not, and none under full
    recomputation, which pushes no mode."""
    import dataclasses

    from activation_checkpointing import checkpoint_blocks
    from model import GPT
    from simulator.clock import RankClock
    from simulator.compute_model import ComputeModel
    from simulator.hardware import load_hardware

    inside = []  # kernels launched inside each checkpointed call of a block
    call = ac._Region.__call__
    models = []

    def watched(self, *args):
        before = models[-1].kernels
        try:
            return call(self, *args)
        finally:
            inside.append(models[-1].kernels - before)
    monkeypatch.setattr(ac._Region, "__call__", watched)

    def issued(hw):
        m = GPT(preset("tiny", n_layers=2), dtype=torch.bfloat16, device="meta")
        checkpoint_blocks(m, mode)
        tokens = torch.empty((2, 17), dtype=torch.long, device="meta")
        inside.clear()
        models.append(ComputeModel(hw, RankClock()))
        with models[-1]:
            m(tokens[:, :-1], tokens[:, 1:]).backward()
        return models[-1].clock.issuing, models[-1].kernels, sum(inside), len(inside)
    base = load_hardware("h100-sxm")
    plain, kernels, _, _ = issued(base)
    floor = 1e-3
    extra, same_kernels, launched_inside, calls = issued(dataclasses.replace(base, selective_floor=floor))
    assert same_kernels == kernels and calls == 4  # (two blocks: each forward, each recomputation)
    charged = (extra - plain) / floor  # ops charged the floor: every kernel launched there, and the views
    if mode == "full":
        assert charged == pytest.approx(0, abs=1e-9)
    else:
        assert charged == pytest.approx(round(charged), abs=1e-6) and charged > launched_inside > 0
