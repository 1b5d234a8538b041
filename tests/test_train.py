"""The training loop: the loss falls toward the floor; sim and gloo give the same losses."""
import pytest
import torch

from model import preset
from playground import Layout, RunConfig
from playground.training import train


def test_loss_falls_toward_the_floor():
    run = RunConfig(model=preset("tiny"), layout=Layout(dp=2, micro_batch_size=8), steps=150, lr=1e-2, progress=False)
    res = train(run)
    first, last = res.losses[0], sum(res.losses[-10:]) / 10
    floor = res.loss_floor
    assert first - floor > 1.5  # starts near log(64)
    assert last - floor < 0.35 * (first - floor), (first, last, floor)  # closed most of the gap
    assert last > floor - 0.05  # and, as it must, never beats the entropy rate by more than noise


@pytest.mark.slow
def test_sim_and_gloo_give_the_same_losses():
    run = RunConfig(model=preset("tiny"), layout=Layout(dp=2, microbatches=2, micro_batch_size=2), steps=3,
                    dtype="float64", progress=False)
    sim = train(run)
    gloo = train(RunConfig(**{**run.__dict__, "backend": "gloo"}))
    assert len(sim.losses) == len(gloo.losses) == 3
    torch.testing.assert_close(torch.tensor(gloo.losses), torch.tensor(sim.losses), rtol=1e-12, atol=0)
    key = lambda e: (e.op, e.label, e.size, e.bytes_sent)  # noqa: E731
    assert [key(e) for e in sim.ledger.for_rank(1)] == [key(e) for e in gloo.ledger.for_rank(1)]


@pytest.mark.parametrize("copies", [True, False])
def test_bfloat16_trains_with_compute_copies_and_under_autocast(copies):
    """bf16 compute copies of fp32 masters by default (the engine at stage 0, 2 bytes a
    weight more), torch.autocast over the fp32 weights with `bf16_copies=False`."""
    run = RunConfig(model=preset("tiny"), layout=Layout(dp=2, micro_batch_size=4), steps=5, dtype="bfloat16",
                    bf16_copies=copies, progress=False)
    res = train(run)
    assert res.losses[-1] < res.losses[0]
    assert any(e.label.startswith("zero") for e in res.ledger.for_rank(0)) == copies
    from playground.report import train_summary
    assert ("bfloat16 (bf16 compute copies of fp32 masters)" if copies else "bfloat16 under autocast") in train_summary(res)


def test_prefetch_worker_gives_each_step_its_rows_in_order():
    """The GPU loop's batches come from a DataLoader worker process: each step's rows of
    the global batch, exactly as the source makes them, in step order; closing it early
    stops the worker."""
    import multiprocessing

    from playground.data import MarkovSource
    from playground.training import Prefetch
    source = MarkovSource(64, seed=4)
    rows = slice(2, 5)
    prefetch = Prefetch(source, 6, 16, rows, "cpu", start=3, stop=9)
    for step in range(3, 7):
        assert torch.equal(prefetch.batch(step), source.global_batch(step, 6, 16)[rows]), step
    try:
        prefetch.batch(8)  # step 7's batch comes next
    except RuntimeError as e:
        assert "made step 7's batch where step 8's was wanted" in str(e)
    else:
        raise AssertionError("a step out of order was not refused")
    prefetch.close()
    assert not [p for p in multiprocessing.active_children() if p.daemon]  # (DataLoader workers are daemons)
