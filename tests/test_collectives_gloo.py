"""Every op on gloo processes gives the same result as on the simulated backend, and the
same ledger bytes. Gloo sums in its own order, so float reductions agree to rounding;
data movement agrees bit for bit."""
import pytest
import torch

from collectives import RankFailedError, launch
from programs import all_ops

TOL = {"float32": 1e-5, "float64": 1e-12, "bfloat16": 2e-2}


def _compare(sim, gloo, dtype):
    for rank, (a, b) in enumerate(zip(sim.values, gloo.values)):
        assert a.keys() == b.keys()
        for key in a:
            x, y = a[key], b[key]
            if key == "reduce" and a["ranks"].index(rank) != len(a["ranks"]) - 1:
                continue  # torch leaves reduce's input unspecified off the destination; gloo overwrites it
            if x is None or y is None:
                assert x is None and y is None, f"rank {rank} {key}"
            elif isinstance(x, torch.Tensor):
                if key.startswith(("all_reduce", "reduce", "async")):
                    torch.testing.assert_close(y, x, rtol=TOL[dtype], atol=TOL[dtype], msg=f"rank {rank} {key}")
                else:
                    assert torch.equal(x, y), f"rank {rank} {key}"
            else:
                assert x == y, f"rank {rank} {key}"
    key = lambda e: (e.rank, e.index, e.op, e.group, e.label, e.dtype, e.size, e.bytes_sent, e.bytes_recv)  # noqa: E731
    assert [key(e) for e in sim.ledger.entries] == [key(e) for e in gloo.ledger.entries]
    assert all(e.end is not None and e.end >= e.start for e in gloo.ledger.entries)


@pytest.mark.parametrize("n,kind,dtype", [
    (3, "world", "float32"), (3, "world", "bfloat16"), (4, "subgroup", "float64"), (4, "mesh", "float32"),
])
@pytest.mark.slow
def test_gloo_matches_sim(n, kind, dtype):
    sim = launch(all_ops, n, args=(kind, dtype))
    gloo = launch(all_ops, n, backend="gloo", args=(kind, dtype))
    assert gloo.backend == "gloo"
    _compare(sim, gloo, dtype)


def failing(world):
    if world.rank == 1:
        raise ValueError("boom on rank 1")
    world.all_reduce(torch.zeros(1))


@pytest.mark.parametrize("n,kind,dtype", [
    (1, "world", "float64"),  # a group of one rank does each op itself, without the backend
    pytest.param(3, "subgroup", "float32", marks=pytest.mark.slow),  # rank 1 alone, ranks 0 and 2 together
])
def test_gloo_group_of_one_matches_sim(n, kind, dtype):
    sim = launch(all_ops, n, args=(kind, dtype))
    gloo = launch(all_ops, n, backend="gloo", args=(kind, dtype))
    _compare(sim, gloo, dtype)


@pytest.mark.slow
def test_gloo_rank_failure_is_reported():
    with pytest.raises(RankFailedError, match="rank 1 raised ValueError: boom on rank 1") as info:
        launch(failing, 2, backend="gloo", timeout=60)
    assert info.value.rank == 1
