"""Pipeline parallelism: every schedule against one device, with and without
DDP; the bubble on the simulated clock against theory; activation memory per schedule."""
import pytest

from model import preset
from pipeline import ScheduleError, build_schedule, makespan, table
from pipeline import partition
from playground import Layout, LayoutError, RunConfig
from playground.bubble import measure, theory
from playground.equivalence import check

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1", 1)]


def _run(p, m, schedule, v=1, dp=1, dtype="float64", n_layers=None, **kw):
    cfg = preset("tiny", n_layers=n_layers or p * v)
    return RunConfig(model=cfg, layout=Layout(pp=p, dp=dp, schedule=schedule, virtual_stages=v, microbatches=m,
                                              micro_batch_size=1, **kw), steps=2, dtype=dtype, progress=False)


def _cases():
    """Every schedule at 2, 3 and 4 stages, with 1, p and 2p + 1 microbatches; at 3 and 4
    stages the default tier keeps 2p + 1 (one microbatch and p are 2 stages' cases again),
    the slow tier the others."""
    for schedule, v in SCHEDULES:
        for p in (2, 3, 4):
            for m in (1, p, 2 * p + 1):
                slow = p > 2 and m != 2 * p + 1
                yield pytest.param(schedule, v, p, m, marks=pytest.mark.slow) if slow else (schedule, v, p, m)


@pytest.mark.parametrize("schedule,v,p,m", list(_cases()))
def test_every_schedule_matches_one_device(schedule, v, p, m):
    run = _run(p, m, schedule, v)
    if schedule == "interleaved" and m % p:
        with pytest.raises(LayoutError, match=f"microbatches={m} is not a multiple of {p}"):
            run.layout.validate(run.model)
        return
    rep = check(run)
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_pipeline_with_data_parallelism_and_float32(schedule, v):
    run = _run(2, 4, schedule, v, dp=2, dtype="float32")
    rep = check(run)
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])
    # DP synchronises each stage's gradients once per step (one bucket per stage here), not per microbatch
    from playground.training import train
    res = train(run)
    for r in range(run.layout.world):
        buckets = [e for e in res.ledger.for_rank(r) if ".bucket" in e.label]
        assert len(buckets) == run.steps * v


def test_uneven_stages_from_a_list():
    assert partition(5, 2, (2, 3)) == [(0, 2), (2, 5)]
    rep = check(_run(2, 3, "1f1b", n_layers=5, stage_layers=(1, 4)))
    assert rep.passed


@pytest.mark.parametrize("schedule,v,sizes,dp,zero", [("1f1b", 1, (0, 3), 1, 0), ("zb1", 1, (3, 0), 2, 0),
                                                      ("interleaved", 2, (0, 2, 1, 0), 2, 1)])
def test_a_stage_may_hold_only_the_embedding_or_only_the_head(schedule, v, sizes, dp, zero):
    # Llama 3's balanced pipeline (Dubey et al. 2024, section 3.3.2): a layer fewer on the
    # first and the last stage, whose first and last chunk hold only the embedding and only
    # the head and the loss
    rep = check(_run(2, 4, schedule, v, dp=dp, n_layers=3, stage_layers=sizes, zero=zero))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


@pytest.mark.sabotage
def test_the_check_catches_gradients_received_in_the_wrong_order(monkeypatch):
    """Rank 0 runs its backwards in reverse: it pairs each microbatch with another's
    output gradient (same shapes), a silent bug only the equivalence check sees."""
    import pipeline.schedules as sch
    original = sch.one_f_one_b

    def swapped(p, m, v=1):
        rows = original(p, m, v)
        bs = [a for a in rows[0] if a.kind == "B"]
        it = iter(reversed(bs))
        rows[0] = [next(it) if a.kind == "B" else a for a in rows[0]]
        return rows
    monkeypatch.setattr(sch, "one_f_one_b", swapped)
    rep = check(_run(2, 2, "1f1b"))
    assert not rep.passed


def test_schedules_print_as_tables():
    text = table(build_schedule("1f1b", 3, 4))
    assert text.splitlines()[0].split()[2:] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert text.splitlines()[2].split()[2:] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    with pytest.raises(ScheduleError, match="needs virtual stages v >= 2"):
        build_schedule("interleaved", 2, 2, 1)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
@pytest.mark.parametrize("m", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_bubble_on_the_simulated_clock_matches_theory(schedule, v, m):
    """Equal stage costs (F = 1 ms, B = 2 ms; ZB-H1: I = W = 1 ms): the bubble measured from
    the simulated clock, sends and receives included, against (p−1)/(m+p−1) for GPipe and
    1F1B, (p−1)/(v·m+p−1) interleaved; ZB-H1's bubble is a third of 1F1B's."""
    p = 4
    res = measure(_run(p, m, schedule, v, n_layers=8))
    assert res["bubble"] == pytest.approx(theory(schedule, p, m, v), abs=0.005)
    # the clock's idle on pipeline calls, per rank: the bubble that plans and reports print
    assert res["clock_bubble"] == pytest.approx([theory(schedule, p, m, v)] * p, abs=0.005)
    if schedule == "zb1":
        step_zb = makespan(build_schedule("zb1", p, m), p)
        step_1f1b = makespan(build_schedule("1f1b", p, m), p)
        assert step_zb - 3 * m == pytest.approx((step_1f1b - 3 * m) / 3)


@pytest.mark.slow
def test_activation_memory_gpipe_holds_m_microbatches_1f1b_at_most_p():
    """Stage 0's peak: one microbatch's backward transients over the activations of the
    microbatches it holds (GPipe m, 1F1B p − r on rank r), each one microbatch's worth."""
    p = 4
    first = measure(_run(p, 1, "gpipe", n_layers=4))["peak_activations"][0]  # one microbatch on stage 0
    one = measure(_run(p, 2, "gpipe", n_layers=4))["peak_activations"][0] - first  # each further one
    assert one > 0.9 * first
    for m in (4, 8):
        gpipe = measure(_run(p, m, "gpipe", n_layers=4))["peak_activations"]
        ofob = measure(_run(p, m, "1f1b", n_layers=4))["peak_activations"]
        assert gpipe[0] == pytest.approx(first + (m - 1) * one, rel=0.01)
        assert ofob[0] == pytest.approx(first + (p - 1) * one, rel=0.01)
        for r in range(p - 1):  # stage r holds p − r microbatches (the last stage adds the head's activations)
            assert ofob[r] == pytest.approx(first + (p - r - 1) * one, rel=0.01)
    # ZB-H1 is bounded like 1F1B, not by m (a W-pending graph must not outlive its W)
    zb = [measure(_run(p, m, "zb1", n_layers=4))["peak_activations"] for m in (8, 16)]
    assert zb[1] == pytest.approx(zb[0], rel=0.02) and max(zb[0]) < 2 * p * one  # (the token ids grow with m)


@pytest.mark.slow
def test_split_backward_does_the_work_of_one_backward():
    """With counted compute (no fixed costs), ZB-H1's I + W cost each rank what 1F1B's B
    does (W takes each layer's weight gradient from the output gradient I kept, it does
    not walk the graph again), and the step is no longer than 1F1B's."""
    from playground.training import train
    steps = {}
    for schedule in ("1f1b", "zb1"):
        run = _run(4, 8, schedule, n_layers=4)
        # (kernels alone: a profile without contention beside the pipeline's calls)
        res = train(RunConfig(**{**run.__dict__, "hardware": "h100-datasheet", "steps": 3}))
        steps[schedule] = [v["sim_steps"][-1] for v in res.values]
    for a, b in zip(steps["1f1b"], steps["zb1"]):
        assert b["compute"] == pytest.approx(a["compute"], rel=1e-6)
    assert max(b["time"] for b in steps["zb1"]) < max(a["time"] for a in steps["1f1b"])


@pytest.mark.parametrize("dp,tp,sp,schedule,v,dtype", [
    (2, 2, False, "1f1b", 1, "float64"),
    (1, 2, True, "zb1", 1, "float64"),
    pytest.param(1, 2, True, "interleaved", 2, "float32", marks=pytest.mark.slow),
    pytest.param(2, 2, True, "gpipe", 1, "float32", marks=pytest.mark.slow),
])
def test_pipeline_with_tensor_and_data_parallelism(dp, tp, sp, schedule, v, dtype):
    """dp × tp × pp on one mesh (the learner's `--dp 2 --tp 2 --pp 2`): stages built from
    Megatron's layers; with SP the activations between stages are sequence slices."""
    run = _run(2, 4, schedule, v, dp=dp, dtype=dtype)
    run = RunConfig(**{**run.__dict__, "model": preset("tiny", vocab_size=61, n_layers=2 * v),
                       "layout": Layout(**{**run.layout.__dict__, "tp": tp, "sequence_parallel": sp})})
    rep = check(run)
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


def test_deferred_weight_gradients_equal_one_backward(monkeypatch):
    """Split mode (I, then W) gives every parameter the gradient of one plain backward, bit
    for bit; I leaves the linear layers' weights untouched and W is one autograd call."""
    import torch
    from model.gpt import GPT
    from pipeline.weight_grad_store import WeightGradStore
    cfg = preset("tiny", n_layers=2, vocab_size=61)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    plain = GPT(cfg, dtype=torch.float64)
    plain(x, x).backward()
    split, store = GPT(cfg, dtype=torch.float64), WeightGradStore()
    assert store.install(split) == 2 * 7 + 1  # q, k, v, o and three SwiGLU matrices per block; the head
    loss = split(x, x)
    with store.collect() as deferred:
        loss.backward()
    assert len(deferred) == 15 and split.lm_head.weight.grad is None and split.norm.weight.grad is not None
    calls, backward = [], torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: calls.append(1) or backward(*a, **k))
    assert WeightGradStore.apply(deferred)
    assert len(calls) == 1
    for (n, a), b in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_the_inputs_kept_for_w_count_as_activations_until_w():
    """Autograd lets go of a linear layer's input and output gradient after I, the store keeps
    them for W: with a memory tracker on (its activations tracked) the store counts each
    distinct storage of them until W has run, and W frees them (the list is emptied)."""
    import torch
    from model.gpt import GPT
    from pipeline.weight_grad_store import WeightGradStore
    from simulator import MemoryTracker
    from simulator.memory import storage_bytes
    cfg = preset("tiny", n_layers=2, vocab_size=61)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    memory = MemoryTracker()
    model = GPT(cfg, dtype=torch.float64)
    store = WeightGradStore()
    store.install(model)
    with memory.track_activations(exclude=list(model.parameters())):
        loss = model(x, x)
        with store.collect() as deferred:
            loss.backward()
        del loss
        kept = storage_bytes(t for x_, g, _, _ in deferred for t in (x_, g))
        assert kept > 0 and memory.activations == kept and memory.temporaries == 0
        assert all(x_.grad_fn is None for x_, _, _, _ in deferred)  # (no graph kept alive through them)
        assert WeightGradStore.apply(deferred)
        assert memory.activations == 0 and len(deferred) == 0


@pytest.mark.sabotage
def test_the_check_catches_a_lost_weight_gradient(monkeypatch):
    """Sabotage: W drops the last deferred layer of each microbatch (the first linear layer
    of the chunk); ZB-H1 must then fail the equivalence check."""
    from pipeline.weight_grad_store import WeightGradStore
    apply = WeightGradStore.apply
    monkeypatch.setattr(WeightGradStore, "apply", staticmethod(lambda entries: apply(entries[:-1])))
    rep = check(_run(2, 4, "zb1"))
    assert not rep.passed


def _eager_gradient_waits(every, rank, p):
    """Each gradient's send waited at the rank's next receive of an input, proof or not."""
    mine, out = every[rank], {}
    for k, a in enumerate(mine):
        if a.kind == "SEND_B":
            at = next((j for j in range(k + 1, len(mine)) if mine[j].kind == "RECV_F"), None)
            if at is not None:
                out.setdefault(at, []).append((a.microbatch, a.chunk))
    return out


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 8, 1), ("1f1b", 4, 8, 1), ("zb1", 4, 8, 1),
                                        ("interleaved", 4, 8, 2), ("gpipe", 3, 4, 1)])
def test_a_gradient_send_is_waited_only_where_a_received_input_proves_it_arrived(name, p, m, v):
    """Where `gradient_send_waits` waits a SEND_B (at a RECV_F of this rank), the previous
    stage's rank sent that input after it had received the gradient; in 1F1B most are
    released before the step ends."""
    from pipeline.executor import gradient_send_waits
    every = build_schedule(name, p, m, v)
    for r in range(p):
        mine, theirs = every[r], every[(r - 1) % p]
        waits = gradient_send_waits(every, r, p)
        for at, keys in waits.items():
            got = mine[at]
            assert got.kind == "RECV_F"
            sent = theirs.index(next(a for a in theirs if a.kind == "SEND_F" and a.microbatch == got.microbatch
                                     and a.chunk == (got.chunk if r > 0 else got.chunk - 1)))
            for mb, c in keys:
                k = next(i for i, a in enumerate(mine) if a.kind == "SEND_B" and (a.microbatch, a.chunk) == (mb, c))
                arrived = next(i for i, a in enumerate(theirs) if a.kind == "RECV_B" and a.microbatch == mb
                               and a.chunk == (c if r > 0 else c - 1))
                assert k < at and arrived < sent
        if name == "1f1b" and r > 0:
            assert sum(map(len, waits.values())) >= m - p


def _plan_pp(schedule, p, v):
    from playground.planning import plan
    model = preset("tiny", d_model=256, d_ff=768, n_layers=8, seq_len=128, vocab_size=256, n_heads=4)
    layout = Layout(pp=p, schedule=schedule, virtual_stages=v, microbatches=8, micro_batch_size=2)
    return plan(RunConfig(model=model, layout=layout, dtype="bfloat16", progress=False, hardware="h100-sxm"))


def test_waiting_gradient_sends_early_costs_no_time_and_frees_memory(monkeypatch):
    """Against waiting every gradient's send at the end of the step: the same simulated step
    (the waits come after the sends have ended), and no rank's peak higher; the ranks that
    send gradients hold fewer of them."""
    import pipeline.executor as ex
    proved = _plan_pp("1f1b", 4, 1)
    monkeypatch.setattr(ex, "gradient_send_waits", lambda every, rank, p: {})
    at_end = _plan_pp("1f1b", 4, 1)
    assert proved.step_s <= at_end.step_s * (1 + 1e-6)
    peaks = [(a["memory"]["peak_total"], b["memory"]["peak_total"]) for a, b in zip(proved.values, at_end.values)]
    assert all(x <= y for x, y in peaks) and all(x < y for x, y in peaks[1:])


@pytest.mark.sabotage
def test_waiting_a_gradient_send_without_proof_deadlocks_the_interleaved_schedule(monkeypatch):
    """Sabotage: each gradient's send waited at the next input received, whether or not its
    sender had received the gradient by then: interleaved 1F1B at p = 4 deadlocks, and the
    simulator says so."""
    import pipeline.executor as ex
    from collectives.errors import DeadlockError
    monkeypatch.setattr(ex, "gradient_send_waits", _eager_gradient_waits)
    with pytest.raises(DeadlockError, match="pp.gradients"):
        _plan_pp("interleaved", 4, 2)
