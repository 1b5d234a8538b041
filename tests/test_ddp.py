"""DDP against the single-device reference through the equivalence check, and its
bucketing, overlap and no_sync behaviour from the ledger."""
import pytest
import torch

from collectives import launch
from ddp import DistributedDataParallel
from model import GPT, preset
from playground import Layout, RunConfig
from playground.equivalence import check


def _ddp_cases():
    """(dp, microbatches, dtype): the default tier holds each dp once in float64 (1 and 4 with
    one microbatch, 2 and 3 with three) and float32 at dp 3 with 3 microbatches; the slow tier
    the rest, with dp 8."""
    default = {(1, 1, "float64"), (4, 1, "float64"), (2, 3, "float64"), (3, 3, "float64"), (3, 3, "float32")}
    for dtype in ("float64", "float32"):
        for microbatches in (1, 3):
            for dp in (1, 2, 3, 4, 8):
                slow = (dp, microbatches, dtype) not in default
                yield pytest.param(dp, microbatches, dtype, marks=pytest.mark.slow) if slow else (dp, microbatches, dtype)


@pytest.mark.parametrize("dp,microbatches,dtype", list(_ddp_cases()))
def test_ddp_matches_the_reference(dp, microbatches, dtype):
    run = RunConfig(model=preset("tiny"), steps=3, dtype=dtype, bucket_cap_mb=0.02,  # several buckets
                    layout=Layout(dp=dp, microbatches=microbatches, micro_batch_size=2))
    rep = check(run)
    assert rep.passed, [r for r in rep.rows if not r.ok] + rep.problems
    assert {r.what for r in rep.rows} == {"loss", "grad", "weight", "moments"}
    assert sum(r.what == "grad" for r in rep.rows) == len(list(GPT(run.model, device="meta").parameters()))


@pytest.mark.sabotage
def test_check_fails_on_a_broken_strategy(monkeypatch):
    """A DDP that sums gradients instead of averaging them (a classic bug) must fail the check."""
    from collectives import ReduceOp

    def summing(self, b):
        b.work = self.group.all_reduce(b.flat, op=ReduceOp.SUM, async_op=True, label=f"ddp.bucket{b.index}")

    monkeypatch.setattr(DistributedDataParallel, "_launch", summing)
    rep = check(RunConfig(model=preset("tiny"), steps=2, dtype="float64", layout=Layout(dp=2, micro_batch_size=2)))
    assert not rep.passed
    assert not rep.worst("grad").ok
    assert rep.worst("grad").max_rel == pytest.approx(1.0, rel=1e-6)  # every gradient doubled
    assert not rep.worst("weight").ok  # through AdamW's eps, the weights show it too


def _ddp_program(world, bucket_mb, microbatches):
    cfg = preset("tiny")
    model = GPT(cfg, seed=world.rank)  # different on purpose: DDP must broadcast rank 0's
    ddp = DistributedDataParallel(model, world, bucket_cap_mb=bucket_mb)
    g = torch.Generator().manual_seed(world.rank)
    for i in range(microbatches):
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
        if i < microbatches - 1:
            with ddp.no_sync():
                ddp(x[:, :-1], x[:, 1:]).backward()
        else:
            ddp(x[:, :-1], x[:, 1:]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, len(ddp.buckets)


@pytest.mark.parametrize("n", [2, 3])
def test_buckets_replicas_and_no_sync(n):
    res = launch(_ddp_program, n, args=(0.01, 3))
    grads0, nbuckets = res.values[0]
    assert nbuckets > 3
    for grads, _ in res.values[1:]:
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), name  # replicas agree bit for bit
    entries = res.ledger.for_rank(0)
    buckets = [e for e in entries if e.label.startswith("ddp.bucket")]
    # three microbatches, two under no_sync: each bucket is reduced exactly once
    assert sorted(e.label for e in buckets) == sorted(f"ddp.bucket{i}" for i in range(nbuckets))
    assert all(e.op == "all_reduce" for e in buckets)
    # bucket 0 holds the last parameters (lm_head first): reverse order of registration
    assert buckets[0].label == "ddp.bucket0"
    model = GPT(preset("tiny"), device="meta")
    total = sum(p.numel() * 4 for p in model.parameters())
    assert sum(e.size for e in buckets) == total
    assert sum(e.bytes_sent for e in buckets) == pytest.approx(2 * (n - 1) / n * total, abs=2 * nbuckets)


def test_bucket_all_reduces_start_during_backward():
    """The first bucket's all-reduce is issued before the last gradient is produced."""
    order = []

    def program(world):
        model = GPT(preset("tiny"), seed=0)
        ddp = DistributedDataParallel(model, world, bucket_cap_mb=0.01)
        model.tok_emb.weight.register_post_accumulate_grad_hook(lambda p: order.append(("emb grad", world.rank)))
        real = world.all_reduce

        def spy(t, *a, **k):
            order.append((k.get("label"), world.rank))
            return real(t, *a, **k)
        world.all_reduce = spy
        x = torch.randint(0, 64, (2, 33))
        ddp(x[:, :-1], x[:, 1:]).backward()
    launch(program, 2)
    mine = [what for what, r in order if r == 0]
    assert mine.index("ddp.bucket0") < mine.index("emb grad")


def test_gradients_are_views_into_the_buckets():
    """After backward every .grad lives in its bucket's flat buffer, so the all-reduce ran
    in place; with zero_grad(set_to_none=False) accumulation stays in the bucket too."""
    def program(world):
        model = GPT(preset("tiny"), seed=0)
        ddp = DistributedDataParallel(model, world, bucket_cap_mb=0.02)
        x = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(world.rank))
        for _ in range(2):
            ddp(x[:, :-1], x[:, 1:]).backward()
            model.zero_grad(set_to_none=False)
        ddp(x[:, :-1], x[:, 1:]).backward()
        inside = all(p.grad.data_ptr() == ddp._bucket_of[p].view(p).data_ptr() for p in model.parameters())
        return inside, {n: p.grad.clone() for n, p in model.named_parameters()}
    res = launch(program, 3)
    assert all(inside for inside, _ in res.values)
    for _, grads in res.values[1:]:
        assert all(torch.equal(grads[n], res.values[0][1][n]) for n in grads)
