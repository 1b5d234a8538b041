"""Placements (docs/architecture.md, Contract 4) and the gather that reads them: every way a
strategy cuts a tensor (slices, padded slices, flat ranges, flat ranges of slices) assembles
back to the full tensor exactly, through views where the cuts are views and through the
index map where they are not; replicas that differ, elements no rank holds and pieces that
do not fit are reported."""
import pytest
import torch

from model import assemble
from model.placement import Flat, Placement, Shard

SHAPE = (7, 6)


def _ranges(n: int, parts: int) -> list:
    """`parts` contiguous ranges covering [0, n), unequal where n is not a multiple."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _rows(parts: int, padded: bool) -> list:
    """A slice of rows per rank; padded: each held in ceil(rows/parts) rows (Megatron's
    vocabulary, an expert range)."""
    length = -(-SHAPE[0] // parts)
    return [Shard(0, a, b, length if padded else b - a) for a, b in _ranges(SHAPE[0], parts)]


def _cases() -> dict:
    """{name: [placement of each rank]}, each family covering the whole tensor."""
    whole = Placement("w", SHAPE)
    cols = [Shard(1, a, b, b - a) for a, b in _ranges(SHAPE[1], 2)]
    return {
        "replicas": [whole, whole],
        "rows": [whole.then(s) for s in _rows(3, False)],
        "rows-padded": [whole.then(s) for s in _rows(3, True)],
        "columns": [whole.then(s) for s in cols],
        "flat": [whole.then(Flat(a, b)) for a, b in _ranges(42, 4)],
        # ZeRO over a TP slice: a view for rows (contiguous), the index map for columns
        "flat-of-rows": [whole.then(s).then(Flat(a, b)) for s in _rows(2, False)
                         for a, b in _ranges((s.stop - s.start) * SHAPE[1], 3)],
        "flat-of-columns": [whole.then(s).then(Flat(a, b)) for s in cols for a, b in _ranges(SHAPE[0] * 3, 2)],
        # a flat range of a padded slice indexes its padding too: the index map
        "flat-of-padded-rows": [whole.then(s).then(Flat(a, b)) for s in _rows(2, True)
                                for a, b in _ranges(s.length * SHAPE[1], 3)],
    }


VIEWS = {"replicas", "rows", "rows-padded", "columns", "flat", "flat-of-rows"}


def _full() -> torch.Tensor:
    return torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(_cases()))
def test_every_cut_assembles_back_to_the_full_tensor(name):
    full, pls = _full(), _cases()[name]
    assert all(pl.region(full) is not None for pl in pls) == (name in VIEWS)  # (else some through the index map)
    got, problems = assemble([[(pl, pl.local(full))] for pl in pls])
    assert problems == [] and torch.equal(got["w"], full)
    for pl in pls:  # the view holds exactly the elements the index map names
        region = pl.region(full)
        if region is not None:
            idx = pl.index()
            if region[1] is not None:
                idx = idx.narrow(region[1][0], 0, region[1][1])
            assert torch.equal(region[0], full.view(-1)[idx.reshape(region[0].shape)])


@pytest.mark.parametrize("name", ["replicas", "rows-padded", "flat-of-columns", "flat-of-padded-rows"])
def test_a_replica_that_differs_is_reported(name):
    """The same piece from two ranks, one element apart in the second: a bug, named."""
    full, pls = _full(), _cases()[name]
    per_rank = [[(pl, pl.local(full))] for pl in pls]
    other = pls[0].local(full).clone()
    other.view(-1)[0] += 1e-12
    _, problems = assemble(per_rank + [[(pls[0], other)]])
    assert len(problems) == 1 and "differs from another rank's by up to 1e-12" in problems[0]


@pytest.mark.parametrize("name", ["rows", "flat-of-rows", "flat-of-columns"])
def test_elements_no_rank_holds_and_pieces_that_do_not_fit_are_reported(name):
    full, pls = _full(), _cases()[name]
    _, problems = assemble([[(pl, pl.local(full))] for pl in pls[1:]])
    missing = int(pls[0].index().ge(0).sum())
    assert problems == [f"w: {missing} of 42 elements are held by no rank"]
    _, problems = assemble([[(pl, pl.local(full))] for pl in pls[1:]] + [[(pls[0], torch.zeros(99))]])
    assert any("does not fit its placement" in p for p in problems) and any("held by no rank" in p for p in problems)
