"""Megatron tensor parallelism with sequence parallelism: equivalence with one
device, the collectives per layer from the ledger, the vocabulary-parallel loss."""
import pytest
import torch
import torch.nn.functional as F

from collectives import launch
from model import preset
from playground import Layout, RunConfig
from playground.equivalence import check
from playground.training import train
from tensor_parallel import vocab_parallel_cross_entropy
from tensor_parallel.layers import shard_range

CFG = preset("tiny", vocab_size=61, n_layers=2)  # 61: the vocabulary is padded for tp = 2 and 4
TP_SP = [(1, False), (2, False), (4, False), (2, True), (4, True)]


def _run(tp, sp, dp=1, dtype="float64", microbatches=2, steps=3, **kw):
    return RunConfig(model=CFG, layout=Layout(dp=dp, tp=tp, sequence_parallel=sp, microbatches=microbatches,
                                              micro_batch_size=2), steps=steps, dtype=dtype, progress=False, **kw)


@pytest.mark.parametrize("tp,sp,dtype", [(tp, sp, "float64") for tp, sp in TP_SP] + [
    (tp, sp, "float32") if (tp, sp) == (2, True) else pytest.param(tp, sp, "float32", marks=pytest.mark.slow)
    for tp, sp in TP_SP])  # (float32 once in the default tier, the rest in the slow one)
def test_tensor_parallel_matches_one_device(tp, sp, dtype):
    rep = check(_run(tp, sp, dtype=dtype))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


@pytest.mark.parametrize("dp,tp,sp", [(2, 2, True), pytest.param(3, 2, False, marks=pytest.mark.slow),
                                      pytest.param(2, 4, True, marks=pytest.mark.slow)])
def test_tensor_parallel_with_ddp_on_one_mesh(dp, tp, sp):
    rep = check(_run(tp, sp, dp=dp))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


@pytest.mark.sabotage
def test_the_check_catches_sequence_parallel_norms_without_their_gradient_all_reduce(monkeypatch):
    import tensor_parallel.plan
    monkeypatch.setattr(tensor_parallel.plan, "copy_to_tp", lambda w, group, label: w)
    rep = check(_run(2, True, microbatches=1, steps=1))
    assert not rep.passed and "norm" in rep.worst("grad").name


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (2, True), (4, True)])
def test_collectives_per_layer_and_microbatch(tp, sp):
    """Per layer and microbatch: 4 all-reduces of b·s·h elements (f backward and g forward,
    for attention and for the MLP), 8·b·s·h·(t-1)/t elements sent per rank with ring;
    with sequence parallelism the same volume as all-gathers and reduce-scatters."""
    steps, m = 2, 2
    res = train(_run(tp, sp, dtype="float32", microbatches=m, steps=steps))
    b, s, h, L = 2, CFG.seq_len, CFG.d_model, CFG.n_layers
    bsh = b * s * h
    labels = ([f"tp.{p}.{op}" for p in ("attn", "mlp") for op in ("sp_gather", "sp_scatter")] if sp else
              [f"tp.{p}.{op}" for p in ("attn", "mlp") for op in ("f", "g")])
    for r in range(tp):
        entries = [e for e in res.ledger.for_rank(r) if e.label in labels]
        if sp:  # gather: all_gather forward, reduce_scatter backward; scatter: the reverse
            assert sorted({(e.label, e.op) for e in entries}) == sorted(
                (lab, op) for lab in labels for op in ("all_gather", "reduce_scatter"))
            assert all(e.shape[0] * e.shape[1] * e.shape[2] in (bsh, bsh // tp) for e in entries)
        else:
            assert {e.op for e in entries} == {"all_reduce"}
            assert all(e.shape == (b, s, h) for e in entries)
        per_layer_mb = len(entries) / (L * m * steps)
        assert per_layer_mb == (8 if sp else 4)
        sent = sum(e.bytes_sent for e in entries) / 4  # float32 elements
        assert sent / (L * m * steps) == 8 * bsh * (tp - 1) / tp


@pytest.mark.parametrize("tp,vocab", [(2, 61), (3, 64), (4, 61)])
def test_vocab_parallel_cross_entropy_equals_the_full_loss_and_ignores_padding(tp, vocab):
    g = torch.Generator().manual_seed(tp)
    logits = torch.randn(10, vocab, dtype=torch.float64, generator=g) * 3
    target = torch.randint(0, vocab, (10,), generator=g)
    full = logits.clone().requires_grad_()
    F.cross_entropy(full, target).backward()

    def fn(world):
        start, stop, local = shard_range(vocab, tp, world.rank)
        mine = torch.full((10, local), 1e4, dtype=torch.float64)  # padding columns hold huge values
        mine[:, :stop - start] = logits[:, start:stop]
        mine.requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, target, start, stop - start, world).mean()
        loss.backward()
        assert torch.all(mine.grad[:, stop - start:] == 0)  # padding gets no gradient (empty when none)
        return loss.item(), mine.grad[:, :stop - start]
    res = launch(fn, tp).values
    ref = F.cross_entropy(logits, target).item()
    for loss, _ in res:
        assert loss == pytest.approx(ref, rel=1e-12)
    grad = torch.cat([gr for _, gr in res], dim=1)
    torch.testing.assert_close(grad, full.grad, rtol=1e-12, atol=1e-15)
