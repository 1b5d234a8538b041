"""Grouped-query attention (Ainslie et al. 2023): fewer key/value heads than query heads,
checked on every layout; tensor parallelism splits the key/value heads too; the ring
carries only the key/value heads."""
import pytest

from model import GPT, preset
from playground import Layout, LayoutError, RunConfig, check, train

GQA = preset("tiny", vocab_size=61, n_kv_heads=2)  # 4 query heads, 2 key/value heads


@pytest.mark.parametrize("axes", [pytest.param(dict(dp=2), marks=pytest.mark.slow), dict(tp=2),
                                  dict(tp=2, sequence_parallel=True, dp=2, zero=3),
                                  dict(cp=2), dict(cp=2, cp_impl="ulysses"),
                                  pytest.param(dict(cp=2, tp=2), marks=pytest.mark.slow),  # (cp and tp apart above)
                                  dict(pp=2, microbatches=2), dict(cp=2, dp=2, model=preset("tiny", vocab_size=61,
                                                                                            n_kv_heads=1))],
                         ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items() if k != "model") or "one")
def test_grouped_query_attention_matches_one_device(axes):
    axes = dict(axes)
    model = axes.pop("model", GQA)
    rep = check(RunConfig(model=model, layout=Layout(micro_batch_size=2, **{"microbatches": 2, **axes}), steps=2,
                          dtype="float64", progress=False))
    assert rep.passed, (rep.problems, [r for r in rep.rows if not r.ok])


def test_parameter_count_and_refusals():
    assert GQA.n_params() == sum(p.numel() for p in GPT(GQA, device="meta").parameters())
    with pytest.raises(LayoutError, match="n_kv_heads=2 is not divisible by tp=4"):
        Layout(tp=4).validate(GQA)
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by n_kv_heads=3"):
        preset("tiny", n_kv_heads=3)


def test_the_ring_carries_only_the_key_value_heads():
    res = train(RunConfig(model=GQA, layout=Layout(cp=2, micro_batch_size=2), steps=1, progress=False))
    b, s = 2, GQA.seq_len
    kv = [e for e in res.ledger.for_rank(0) if e.label == "cp.ring.kv" and e.op == "send"]
    assert {e.bytes_sent for e in kv} == {2 * b * (s // 2) * GQA.kv_dim * 4}
