"""The memory tracker against the bytes a rank's program really holds (simulator/live_bytes.py,
playground/memory_audit.py): every storage an op makes, counted while it lives. A plan's
peak is only as good as the tracker's count of what the program holds; each case here failed
before the tracker was told of what it missed (a pipeline's stage outputs, received
gradients and sends; split backward's inputs held until W, and the graph they kept; a
recomputed block's activations; temporaries counted by their tensor, not their storage; a
MoE layer's compiled regions run as eager graphs, which keep more than the GPU's; an
all-to-all's buffers kept by its Work until backward; what a fused region leaves counted by
its tensors, not its storages, which missed what a recomputation saves)."""
import pytest
import torch

from benchmarks.memory_audit import DSMOE, MODEL, MOE
from model import preset
from playground import Layout, RunConfig
from playground.memory_audit import audit
from simulator import MemoryTracker
from simulator.live_bytes import LiveBytes

# benchmarks/memory_audit.py's models: MODEL big enough that the bytes of the step's
# activations outweigh the few small tensors the two count differently (the rotary tables,
# made before the step and saved in it: the tracker counts them, the live count had them
# already), small enough to plan in a fraction of a second; its MoE variants below
WITHIN = 0.01  # of the tracked peak


def test_live_bytes_counts_each_storage_while_it_lives():
    live = LiveBytes()
    with live:
        a = torch.empty(1000)  # 4,000 bytes
        view = a[10:]
        b = torch.empty(250, dtype=torch.float64)  # 2,000
        assert live.live == live.peak == 6000
        del a
        assert live.live == 6000  # (the view keeps the storage)
        del view
        assert live.live == 2000
        c = b * 2
        assert live.live == 4000 and live.peak == 6000
        del b, c
        assert live.live == 0
        live.reset_peak()
        torch.empty(10, device="meta")  # (freed at once)
        assert live.live == 0 and live.peak == 40


def test_live_bytes_counts_what_a_fused_region_leaves():
    """Inside a fused region (one GPU kernel, run op by op here) only the outputs alive at its
    end count: its intermediates never exist on a GPU."""
    from model.regions import fused_kernel
    live = LiveBytes()
    with live:
        x = torch.ones(1000)
        live.reset_peak()
        with fused_kernel(0, "test"):
            y = (x * 2 + 1).exp()  # two intermediates of 4,000 bytes, freed inside
        assert live.live == 8000 and live.peak == 8000
        del y


def test_a_storage_held_twice_counts_once_in_the_category_still_holding_it():
    """A pipeline stage's output held as an activation and by its send counts once; when the
    backward lets go, its bytes move to the buffers while the send holds them."""
    tracker = MemoryTracker()
    t = torch.empty(100)
    out = tracker.hold(t, "activations")
    send = tracker.hold(t, "comm_buffers")
    assert tracker.activations == 400 and tracker.comm_buffers == 0
    del out
    assert tracker.activations == 0 and tracker.comm_buffers == 400
    del send
    assert tracker.comm_buffers == 0 and tracker.peak_transient == 400


def test_a_model_state_made_in_the_step_is_not_counted_and_one_made_before_stays():
    """A parameter's .grad made in backward (float32 without ZeRO) is a model state to the
    tracker, so the live count drops it; a storage alive before the step (a DDP bucket, whose
    views are the .grads) is the baseline's and stays."""
    live = LiveBytes()
    with live:
        bucket = torch.empty(100)  # 400 bytes, before the step
        live.reset_peak()
        grad = torch.empty(50)  # 200, made in the step
        assert live.live == 600
        live.model_state(grad)
        live.model_state(bucket[10:])
        assert live.live == 400
        again = grad * 1  # (a new storage: counted)
        assert live.live == 600
        del grad, again
        assert live.live == 400
        del bucket
        assert live.live == 0


def test_live_bytes_follow_a_resized_storage():
    """ZeRO-3 frees its gathered parameters by resizing their storage to nothing and fills it
    again (model.regions.resize_storage), which no dispatch mode sees: the live count is told."""
    from model.regions import resize_storage
    live = LiveBytes()
    with live:
        flat = torch.empty(100)  # 400 bytes
        view = flat[:10]
        resize_storage(flat, 0)
        assert live.live == 0 and live.peak == 400
        live.reset_peak()
        resize_storage(flat, 800)
        assert live.live == live.peak == 800
        del flat, view
        assert live.live == 0


def test_a_watched_storage_counts_until_it_is_freed():
    tracker = MemoryTracker()
    t = torch.empty(100)
    v = t.view(10, 10)
    tracker.watch(t)
    tracker.watch(v)  # (the same storage: counted once)
    assert tracker.activations == 400
    del t
    assert tracker.activations == 400
    del v
    assert tracker.activations == 0


LAYOUTS = [
    {},
    {"dp": 2, "zero": 2},
    {"dp": 2, "zero": 3},
    {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True},
    {"tp": 2, "sequence_parallel": True},
    {"cp": 2},
    {"pp": 2, "schedule": "1f1b", "microbatches": 4},
    {"pp": 2, "schedule": "zb1", "microbatches": 4},
    {"pp": 2, "schedule": "interleaved", "microbatches": 4, "virtual_stages": 2, "stage_layers": None},
    {"ac": "full"},
    {"ac": "selective"},
]
SLOW_LAYOUTS = [
    {"dp": 2}, {"dp": 2, "zero": 1}, {"tp": 2}, {"cp": 2, "cp_impl": "ulysses"},
    {"dp": 4, "zero": 3, "dp_replicate": 2}, {"dp": 2, "zero": 3, "ac": "full"},
    {"dp": 2, "zero": 3, "pp": 2, "microbatches": 4},
    {"pp": 2, "schedule": "gpipe", "microbatches": 4},
    {"pp": 2, "microbatches": 4, "ac": "full"},
    {"dp": 2, "tp": 2, "pp": 2, "microbatches": 4},
    {"tp": 2, "sequence_parallel": True, "pp": 2, "schedule": "zb1", "microbatches": 4},
]


def _audit(kw, dtype="bfloat16", model=MODEL):
    run = RunConfig(model=model, layout=Layout(**{"micro_batch_size": 2, **kw}), dtype=dtype, progress=False)
    return audit(run)


def _check(kw, model=MODEL, dtype="bfloat16"):
    for rank, r in enumerate(_audit(kw, dtype=dtype, model=model)):
        assert abs(r["missed"]) <= WITHIN * r["tracked"], (
            f"{dtype} {kw} rank {rank}: the program held {r['live']:,} bytes at its peak, the tracker counted "
            f"{r['tracked']:,}")


# float32 and float64 (no compute copies: each parameter's .grad made in backward, a model
# state; under DDP a view of its bucket) and float16 (loss-scaled compute copies)
DTYPE_LAYOUTS = [("float32", {}), ("float32", {"dp": 2}), ("float64", {"pp": 2, "microbatches": 4}),
                 ("float16", {"dp": 2, "zero": 1})]
SLOW_DTYPE_LAYOUTS = [("float32", {"dp": 2, "zero": 3}), ("float32", {"cp": 2}), ("float32", {"tp": 2}), ("float64", {"dp": 2, "tp": 2, "pp": 2, "microbatches": 4}),
                      ("float32", {"pp": 2, "schedule": "zb1", "microbatches": 4}), ("float64", {"ac": "full"})]


@pytest.mark.parametrize("kw", LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()) or "single")
def test_the_tracker_counts_what_the_program_holds(kw):
    """bf16 (the mixed precision a plan prices): the tracker's peak of the step's transient
    bytes is the peak of the bytes the program made in the step and held at once, within 1%."""
    _check({k: v for k, v in kw.items() if v is not None})


@pytest.mark.slow
@pytest.mark.parametrize("kw", SLOW_LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_the_tracker_counts_what_the_program_holds_in_more_layouts(kw):
    _check(kw)


def _dtype_id(case):
    dtype, kw = case
    return "-".join([dtype] + [f"{k}{v}" for k, v in kw.items()])


def test_a_gradient_reduced_in_float32_is_counted_while_in_flight():
    """bf16 gradients reduced in float32 (`--reduce-dtype float32`) go through a float32 copy
    that lives until the reduction's result is collected; under ZB-H1 the reduction starts in
    the W pass, outside any autograd node, where no backward temporary is counted."""
    short = MODEL.with_(seq_len=16)  # (few activations beside the gradients)
    run = RunConfig(model=short, layout=Layout(micro_batch_size=1, dp=2, zero=1, pp=2, schedule="zb1", microbatches=4),
                    dtype="bfloat16", reduce_dtype="float32", progress=False)
    for r in audit(run):
        assert abs(r["missed"]) <= WITHIN * r["tracked"], r


@pytest.mark.parametrize("case", DTYPE_LAYOUTS, ids=_dtype_id)
def test_the_tracker_counts_what_the_program_holds_in_other_dtypes(case):
    _check(case[1], dtype=case[0])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_DTYPE_LAYOUTS, ids=_dtype_id)
def test_the_tracker_counts_what_the_program_holds_in_other_dtypes_and_layouts(case):
    _check(case[1], dtype=case[0])


# mixture of experts, whose layer runs as compiled regions (model/compiled.py): one on a rank
# that keeps its experts' tokens, routing, balancing losses, the slots' pad and unpad and the
# local experts where they go to other ranks; a plan runs each as the graphs AOTAutograd's
# partition makes, which keep what a GPU's compiled region keeps (MOE: 4 experts top-2; DSMOE:
# 8 fine-grained experts top-2 beside a shared one, dropless)
# (dsmoe at ep 2: its shared expert runs while the combine is in flight, whose Work held both
# of the call's buffers until backward)
# (under recomputation the regions run again inside backward, op by op, and torch's checkpoint
# keeps what they save as detached views: the regions' own tensors are gone by their end, their
# storages not; counted by tensor, full recomputation's peak was missed by half)
MOE_LAYOUTS = [("moe", MOE, {}), ("moe-dp2-ep2", MOE, {"dp": 2, "ep": 2}), ("dsmoe-dp2-ep2", DSMOE, {"dp": 2, "ep": 2}),
               ("moe-ac-selective", MOE, {"ac": "selective"}), ("moe-ac-full", MOE, {"ac": "full"})]
SLOW_MOE_LAYOUTS = [("dsmoe", DSMOE, {}), ("moe-ep2-tp2-sp", MOE, {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True}),
                    ("dsmoe-capacity-dp2-ep2", DSMOE.with_(capacity_factor=1.0), {"dp": 2, "ep": 2}),
                    ("moe-dp2-ep2-ac-selective-op", MOE, {"dp": 2, "ep": 2, "ac": "selective-op"}),
                    ("dsmoe-tp2-sp-ac-full", DSMOE, {"tp": 2, "sequence_parallel": True, "ac": "full"})]


@pytest.mark.parametrize("name,model,kw", MOE_LAYOUTS, ids=[m[0] for m in MOE_LAYOUTS])
def test_the_tracker_counts_what_a_moe_layer_holds(name, model, kw):
    _check(kw, model)


@pytest.mark.slow
@pytest.mark.parametrize("name,model,kw", SLOW_MOE_LAYOUTS, ids=[m[0] for m in SLOW_MOE_LAYOUTS])
def test_the_tracker_counts_what_a_moe_layer_holds_in_more_layouts(name, model, kw):
    _check(kw, model)


@pytest.mark.sabotage
def test_a_region_that_keeps_its_saved_tensors_past_the_hooks_fails_the_audit(saves_past_the_hooks):
    """Sabotage: the MoE layer's compiled regions keep what they save on their autograd node
    instead of through save_for_backward: the program holds them uncounted."""
    with pytest.raises(AssertionError, match="the tracker counted"):
        _check({}, MOE)


@pytest.mark.sabotage
def test_zero3_that_tells_the_tracker_nothing_fails_the_audit(monkeypatch):
    """Sabotage: ZeRO counts none of its buffers (stage 3's gathered parameters, the full
    gradients it reduce-scatters): the program holds them uncounted."""
    from zero.zero import ZeroDataParallel
    monkeypatch.setattr(ZeroDataParallel, "_buffer", lambda self, nbytes, made=None: None)
    with pytest.raises(AssertionError, match="the tracker counted"):
        _check({"dp": 2, "zero": 3})


@pytest.mark.sabotage
def test_gradients_left_as_temporaries_fail_the_audit(monkeypatch):
    """Sabotage: the tracker does not claim a parameter's .grad as a model state (float32
    without ZeRO makes it in backward): it counts every gradient as a temporary for good."""
    monkeypatch.setattr(MemoryTracker, "_grad_accumulated", lambda self, p: None)
    with pytest.raises(AssertionError, match="the tracker counted"):
        _check({}, dtype="float32")


@pytest.mark.sabotage
def test_a_pipeline_executor_that_tells_the_tracker_nothing_fails_the_audit(monkeypatch):
    """Sabotage: the executor keeps stage outputs, received gradients and sent tensors between
    its actions without telling the tracker (as it did): the program holds them uncounted."""
    from pipeline import executor
    monkeypatch.setattr(executor._Kept, "__call__", lambda self, name, t, category: None)
    with pytest.raises(AssertionError, match="the tracker counted"):
        _check({"pp": 2, "schedule": "1f1b", "microbatches": 4})


@pytest.mark.sabotage
def test_recomputation_left_uncounted_fails_the_audit(monkeypatch):
    """Sabotage: what a checkpointed block's recomputation makes is not counted (torch's
    checkpoint holds it outside the saved-tensor hooks): full recomputation's peak is missed."""
    monkeypatch.setattr(MemoryTracker, "watch_storage", lambda self, s, category="activations": None)
    with pytest.raises(AssertionError, match="the tracker counted"):
        _check({"ac": "full"})


@pytest.mark.sabotage
def test_a_w_pass_that_leaves_its_inputs_alive_fails_the_audit(monkeypatch):
    """Sabotage: W computes the weight gradients but the list keeps its inputs and output
    gradients (as a caller's variable did until the next I pass): the program holds them, the
    tracker has let go."""
    from pipeline.weight_grad_store import WeightGradStore
    apply = WeightGradStore.apply
    kept = []

    def leaky(entries):
        kept.append(list(entries))
        return apply(entries)

    monkeypatch.setattr(WeightGradStore, "apply", staticmethod(leaky))
    with pytest.raises(AssertionError, match="the tracker counted"):
        _check({"pp": 2, "schedule": "zb1", "microbatches": 4})


def test_invalid_layouts_are_refused():
    from playground import LayoutError
    with pytest.raises(LayoutError, match="ep=2"):
        audit(RunConfig(model=preset("tiny-moe"), layout=Layout(ep=2, micro_batch_size=2), dtype="bfloat16",
                        progress=False))
