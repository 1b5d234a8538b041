"""Every collective of the simulated backend against an independent reference, on random
data, for several world sizes (non-powers of two included), dtypes and group kinds."""
import numpy as np
import pytest
import torch

from collectives import Mesh, ReduceOp, launch
from programs import all_ops
from reference import expected

WORLD_SIZES = [1, 2, 3, 4, 5, 8, 16]


def assert_same(got, exp, where):
    if exp is None:
        assert got is None or where.endswith(("reduce", "gather")), where
        return
    if isinstance(exp, torch.Tensor):
        assert got.dtype == exp.dtype and got.shape == exp.shape, f"{where}: {got.dtype}{list(got.shape)} vs {exp.dtype}{list(exp.shape)}"
        assert torch.equal(got, exp), f"{where}: max abs diff {(got.double() - exp.double()).abs().max()}"
    else:
        assert got == exp, where


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("kind", ["world", "subgroup", "mesh"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_every_op_matches_reference(n, kind, dtype):
    res = launch(all_ops, n, args=(kind, dtype))
    for rank, out in enumerate(res.values):
        ranks = out["ranks"]
        exp = expected(ranks, ranks.index(rank), dtype)
        assert set(out) == set(exp)
        for key in exp:
            assert_same(out[key], exp[key], f"rank {rank} {kind} n={n} {dtype} {key}")


def test_bit_identical_across_runs():
    """Fixed reduction order: the same inputs give the same bits whatever the thread timing."""
    def fn(world):
        g = torch.Generator().manual_seed(world.rank)
        x = torch.randn(10000, generator=g, dtype=torch.float32) * 10 ** world.rank
        world.all_reduce(x)
        return x
    first = launch(fn, 7).values[0]
    for _ in range(5):
        for v in launch(fn, 7).values:
            assert torch.equal(v, first)


def test_numpy_arrays_and_float16_and_ints():
    def fn(world):
        a = np.full((3,), world.rank + 1, dtype=np.int64)
        world.all_reduce(a, op=ReduceOp.PRODUCT)
        h = np.full((2,), 0.1, dtype=np.float16)
        world.all_reduce(h)
        out = np.empty((world.size * 2,), dtype=np.int32)
        world.all_gather(out, np.array([world.rank, -world.rank], dtype=np.int32))
        return a, h, out
    res = launch(fn, 5)
    a, h, out = res.values[2]
    assert (a == 120).all()
    assert h.dtype == np.float16 and (h == np.float16(np.float32(np.float16(0.1)) * 5)).all()
    assert out.tolist() == [0, 0, 1, -1, 2, -2, 3, -3, 4, -4]


def test_avg_of_integers_fails_on_every_rank():
    def fn(world):
        world.all_reduce(np.ones(2, dtype=np.int64), op=ReduceOp.AVG)
    with pytest.raises(Exception, match="AVG needs a floating dtype"):
        launch(fn, 3)


def test_meta_tensors_move_nothing_but_are_counted():
    def fn(world):
        x = torch.empty((1024, 1024), device="meta", dtype=torch.bfloat16)
        world.all_reduce(x, label="meta.ar")
        out = torch.empty((world.size * 1024, 1024), device="meta", dtype=torch.bfloat16)
        world.all_gather(out, x, label="meta.ag")
        return x.device.type
    res = launch(fn, 4)
    assert res.values == ["meta"] * 4
    S = 1024 * 1024 * 2
    assert res.ledger.bytes_sent(0, label="meta.ar") == 2 * 3 * S // 4
    assert res.ledger.bytes_sent(0, label="meta.ag") == 3 * S


def test_in_place_all_gather_and_reduce_scatter():
    """inp may be a slice of out (all_gather) and out a slice of inp (reduce_scatter), as in torch."""
    def fn(world):
        n, r = world.size, world.rank
        buf = torch.zeros(n * 2, dtype=torch.float64)
        buf[2 * r:2 * r + 2] = torch.tensor([r, 10.0 * r])
        world.all_gather(buf, buf[2 * r:2 * r + 2])
        big = torch.arange(n * 2, dtype=torch.float64) + r
        world.reduce_scatter(big[2 * r:2 * r + 2], big)
        return buf, big[2 * r:2 * r + 2]
    res = launch(fn, 3)
    for r, (buf, part) in enumerate(res.values):
        assert buf.tolist() == [0, 0, 1, 10, 2, 20]
        assert part.tolist() == [3 * (2 * r) + 3, 3 * (2 * r + 1) + 3]


def test_tensors_that_require_grad():
    def fn(world):
        w = torch.ones(4, 3, requires_grad=True)
        with torch.no_grad():
            world.all_reduce(w)
        return w.detach()
    assert (launch(fn, 3).values[1] == 3).all()


@pytest.mark.parametrize("call", ["all_reduce", "reduce", "broadcast", "send"])
def test_a_strided_view_is_refused_as_nccl_refuses_it(call):
    """NCCL refuses a non-contiguous tensor; gloo's all_reduce and broadcast reduce its first
    numel elements of storage instead (a silent wrong answer) and its send refuses it. The
    simulated backend refuses it in one line, so that a layout that would fail or go wrong on
    real ranks fails here first (a pipeline's sequence-parallel activations once did)."""
    def fn(world):
        col = torch.zeros(3, 4).t()[1]  # a column: stride 4
        if call == "send":
            (world.send(col, 1) if world.rank == 0 else world.recv(col, 0))
        else:
            getattr(world, call)(col)
    with pytest.raises(Exception, match=r"tensor must be contiguous \(shape \(3,\)\)"):
        launch(fn, 2)


def test_argument_errors_name_the_values():
    def bad_out(world):
        world.all_gather(torch.empty(3), torch.empty(2))
    with pytest.raises(Exception, match=r"out must hold 2 × inp \(2 × 2 float32 elements\), got 3"):
        launch(bad_out, 2)

    def bad_root(world):
        world.broadcast(torch.empty(2), src=5)
    with pytest.raises(Exception, match=r"src=5 is not a rank of this group \(group ranks are 0..1\)"):
        launch(bad_root, 2)

    def bad_splits(world):
        world.all_to_all(torch.empty(4), torch.empty(4), in_splits=[1, 1])
    with pytest.raises(Exception, match=r"in_splits=\[1, 1\] must have 2 non-negative entries summing to dim 0 = 4"):
        launch(bad_splits, 2)

    def scatter_without_inp(world):
        world.scatter(torch.empty(2), None, src=1)
    with pytest.raises(Exception, match=r"scatter: inp is required on the source rank 1"):
        launch(scatter_without_inp, 2)

    def gather_small_out(world):
        world.gather(torch.empty(5), torch.empty(3), dst=0)
    with pytest.raises(Exception, match=r"gather: out must hold 2 × inp \(2 × 3 float32 elements\), got 5"):
        launch(gather_small_out, 2)

    def reduce_scatter_wrong_dtype(world):
        world.reduce_scatter(torch.empty(2), torch.empty(4, dtype=torch.float64))
    with pytest.raises(Exception, match=r"reduce_scatter: inp must hold 2 × out \(2 × 2 float32 elements\), "
                                        r"got 4 float64"):
        launch(reduce_scatter_wrong_dtype, 2)

    def not_a_tensor(world):
        world.all_reduce([1.0, 2.0])
    with pytest.raises(Exception, match=r"tensor must be a torch.Tensor or numpy.ndarray, got list"):
        launch(not_a_tensor, 2)


def test_mesh_coordinates_and_groups():
    def fn(world):
        mesh = Mesh(world, pp=2, dp=3, tp=2)
        return {
            "coords": (mesh.coord("pp"), mesh.coord("dp"), mesh.coord("tp")),
            "tp": mesh.group("tp").ranks, "dp": mesh.group("dp").ranks, "pp": mesh.group("pp").ranks,
            "dp_tp": mesh.group("dp", "tp").ranks, "pp_tp": mesh.group("tp", "pp").ranks,
            "sizes": (mesh.size("pp"), mesh.size("dp"), mesh.size("tp"), mesh.size()),
        }
    res = launch(fn, 12)
    v = res.values[7]  # 7 = (pp 1, dp 0, tp 1)
    assert v["coords"] == (1, 0, 1)
    assert v["tp"] == (6, 7)
    assert v["dp"] == (7, 9, 11)
    assert v["pp"] == (1, 7)
    assert v["dp_tp"] == (6, 7, 8, 9, 10, 11)
    assert v["pp_tp"] == (0, 1, 6, 7)
    assert v["sizes"] == (2, 3, 2, 12)


def test_mesh_rejects_a_shape_that_does_not_fit():
    def fn(world):
        Mesh(world, dp=2, tp=3)
    with pytest.raises(Exception, match=r"Mesh dp=2 × tp=3 = 6 ranks, but the group has 4 ranks"):
        launch(fn, 4)


def test_mesh_groups_work_concurrently():
    """Each tp group reduces on its own while the dp groups reduce across them."""
    def fn(world):
        mesh = Mesh(world, dp=2, tp=3)
        x = torch.tensor([float(world.rank)])
        mesh.group("tp").all_reduce(x)
        mesh.group("dp").all_reduce(x)
        return x.item()
    assert launch(fn, 6).values == [15.0] * 6


@pytest.mark.slow
def test_large_worlds():
    """1024 ranks reduce correctly, and 256 ranks on a 4-axis mesh reduce within each group."""
    def fn(world):
        x = torch.tensor([float(world.rank)], dtype=torch.float64)
        world.all_reduce(x)
        mesh = Mesh(world, pp=4, dp=4, cp=4, tp=4) if world.size == 256 else None
        y = None
        if mesh is not None:
            y = torch.tensor([float(world.rank)], dtype=torch.float64)
            mesh.group("tp").all_reduce(y)
            mesh.group("dp", "cp").all_reduce(y)
        return x.item(), None if y is None else y.item()
    res = launch(fn, 1024)
    assert all(v == (1024 * 1023 / 2, None) for v in res.values)
    assert len(res.ledger) == 1024
    res = launch(fn, 256)
    for r, (total, y) in enumerate(res.values):
        assert total == 256 * 255 / 2
        pp = r // 64
        # tp then dp×cp: the sum of the 64 ranks sharing this rank's pp coordinate
        assert y == sum(range(pp * 64, pp * 64 + 64)), r


def test_a_rank_failure_survives_pickling():
    """A failure raised in one process and read in another (gloo's launcher, a process pool
    of checks) keeps its rank and message; unpickling it used to raise a TypeError instead."""
    import pickle
    from collectives import RankFailedError
    e = pickle.loads(pickle.dumps(RankFailedError(3, "rank 3 raised ValueError: x")))
    assert isinstance(e, RankFailedError) and e.rank == 3 and str(e) == "rank 3 raised ValueError: x"
