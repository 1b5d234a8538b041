"""A wrong program fails at once with a message naming the ranks and calls involved."""
import threading
import time

import pytest
import torch

from collectives import (CollectiveMismatchError, DeadlockError, Mesh, RankFailedError, ReduceOp,
                         launch)


def run_failing(fn, n, exc_type):
    """launch must raise `exc_type` quickly (no timeout involved) and leave no thread behind."""
    before = threading.active_count()
    t = time.monotonic()
    with pytest.raises(exc_type) as info:
        launch(fn, n)
    # a generous bound: the point is that nothing waits for a timeout
    assert time.monotonic() - t < 10
    assert threading.active_count() == before
    return str(info.value), info


def test_different_ops_at_the_same_point():
    def fn(world):
        x = torch.zeros(4)
        if world.rank == 1:
            world.broadcast(x, src=0, label="bcast")
        else:
            world.all_reduce(x, label="sum")
    msg, _ = run_failing(fn, 3, CollectiveMismatchError)
    assert "different operations" in msg
    assert "rank 1 (group rank 1): broadcast(tensor=[4], dtype=float32, root=0, label='bcast') at test_failures.py:" in msg
    assert "rank 0 (group rank 0): all_reduce(tensor=[4], dtype=float32, op=SUM, label='sum') at test_failures.py:" in msg


@pytest.mark.parametrize("variant,why", [
    ("shape", "different shapes"), ("dtype", "different dtypes"), ("root", "different roots"),
    ("op", "different reduce ops"), ("label", "different labels"),
])
def test_argument_mismatches(variant, why):
    def fn(world):
        odd = world.rank == 2
        shape = (5,) if variant == "shape" and odd else (4,)
        dtype = torch.float64 if variant == "dtype" and odd else torch.float32
        x = torch.zeros(shape, dtype=dtype)
        if variant == "root":
            world.broadcast(x, src=1 if odd else 0)
        else:
            world.all_reduce(x, op=ReduceOp.MAX if variant == "op" and odd else ReduceOp.SUM,
                             label="other" if variant == "label" and odd else "grads")
    msg, _ = run_failing(fn, 4, CollectiveMismatchError)
    assert why in msg
    assert msg.count("at test_failures.py:") == 4  # every rank's call, with its site


def test_all_to_all_split_disagreement():
    def fn(world):
        outs = [2, 2] if world.rank == 0 else [1, 3]
        world.all_to_all(torch.zeros(sum(outs)), torch.zeros(4), out_splits=outs, in_splits=[2, 2])
    msg, _ = run_failing(fn, 2, CollectiveMismatchError)
    assert "group rank 0 sends 2 rows to group rank 1, which expects 1" in msg


def test_mismatch_on_a_subgroup_names_global_ranks():
    def fn(world):
        mesh = Mesh(world, dp=2, tp=2)
        x = torch.zeros(3 if world.rank == 3 else 2)
        mesh.group("dp").all_reduce(x)
    msg, _ = run_failing(fn, 4, CollectiveMismatchError)
    assert "group [1, 3]" in msg and "rank 3 (group rank 1)" in msg


def test_rank_that_skips_a_collective_deadlocks():
    def fn(world):
        if world.rank != 2:
            world.all_reduce(torch.zeros(2), label="grads")
    msg, _ = run_failing(fn, 3, DeadlockError)
    assert "rank 2: has returned" in msg
    assert "rank 0: waits in all_reduce(tensor=[2], dtype=float32, op=SUM, label='grads') at test_failures.py:" in msg
    assert "ranks [2] never arrived" in msg


def test_recv_without_send():
    def fn(world):
        if world.rank == 1:
            world.recv(torch.zeros(3), src=0, label="act")
    msg, _ = run_failing(fn, 2, DeadlockError)
    assert "rank 1: waits in recv(tensor=[3], dtype=float32, peer=0, label='act')" in msg
    assert "the peer never posted the matching call" in msg


def test_two_sends_facing_each_other():
    """Blocking send meets blocking send: a real NCCL program hangs here."""
    def fn(world):
        other = 1 - world.rank
        world.send(torch.zeros(3), other)
        world.recv(torch.zeros(3), other)
    msg, _ = run_failing(fn, 2, DeadlockError)
    assert "rank 0: waits in send" in msg and "rank 1: waits in send" in msg


def test_groups_entered_in_opposite_orders():
    def fn(world):
        a = world.new_group([0, 1, 2])
        b = world.new_group([0, 1, 2, 3])
        x = torch.zeros(1)
        if world.rank == 3:
            b.all_reduce(x, label="b")
            return
        if world.rank == 0:
            b.all_reduce(x, label="b")
            a.all_reduce(x, label="a")
        else:
            a.all_reduce(x, label="a")
            b.all_reduce(x, label="b")
    msg, _ = run_failing(fn, 4, DeadlockError)
    assert "rank 0: waits in all_reduce" in msg and "label='b'" in msg and "label='a'" in msg


def test_exception_in_one_rank_stops_all():
    def fn(world):
        if world.rank == 2:
            raise ValueError("bad batch 17")
        world.all_reduce(torch.zeros(2))
        world.all_reduce(torch.zeros(2))
    msg, info = run_failing(fn, 4, RankFailedError)
    assert info.value.rank == 2
    assert msg.startswith("rank 2 raised ValueError: bad batch 17")
    assert "traceback of rank 2" in msg and "in fn" in msg
    assert isinstance(info.value.__cause__, ValueError)


def test_exception_after_others_passed_their_last_collective():
    def fn(world):
        world.barrier()
        if world.rank == 0:
            raise KeyError("late")
        return world.rank
    msg, info = run_failing(fn, 3, RankFailedError)
    assert info.value.rank == 0 and "KeyError" in msg


def test_async_op_never_waited_by_a_finished_rank_is_fine():
    def fn(world):
        x = torch.ones(2)
        world.all_reduce(x, async_op=True)
        return 1
    assert launch(fn, 3).values == [1, 1, 1]


def test_async_work_waited_after_a_deadlock_free_mix():
    def fn(world):
        x = torch.ones(2)
        w = world.all_reduce(x, async_op=True)
        y = torch.ones(1)
        world.broadcast(y, src=0)
        w.wait()
        assert w.is_completed()
        return x.tolist()
    assert launch(fn, 4).values == [[4.0, 4.0]] * 4
