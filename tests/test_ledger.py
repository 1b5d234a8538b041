"""Ledger bytes against the closed forms of Contract 2 (nccl-tests definitions)."""
from fractions import Fraction

import pytest
import torch

from collectives import launch
from collectives.algorithms import bus_factor
from collectives.ledger import LedgerEntry
from programs import all_ops


def _ops(world):
    n, r = world.size, world.rank
    world.all_reduce(torch.zeros(n * 6, dtype=torch.float32), label="ar")
    world.all_gather(torch.zeros(n * 5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), label="ag")
    world.reduce_scatter(torch.zeros(7, dtype=torch.bfloat16), torch.zeros(n * 7, dtype=torch.bfloat16), label="rs")
    world.all_to_all(torch.zeros(n * 3, 2), torch.zeros(n * 3, 2), label="a2a")
    world.broadcast(torch.zeros(9), src=n - 1, label="bc")
    world.reduce(torch.zeros(9), dst=0, label="red")
    world.scatter(torch.zeros(4), torch.zeros(4 * n) if r == 0 else None, src=0, label="sc")
    world.gather(torch.zeros(4 * n) if r == 0 else None, torch.zeros(4), dst=0, label="ga")
    if n > 1:
        if r == 0:
            world.send(torch.zeros(11, dtype=torch.float64), 1, label="p2p")
        elif r == 1:
            world.recv(torch.zeros(11, dtype=torch.float64), 0, label="p2p")
    world.barrier(label="bar")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bytes_follow_the_closed_forms(n):
    led = launch(_ops, n).ledger
    for r in range(n):
        e = {x.label: x for x in led.for_rank(r)}
        S = n * 6 * 4
        assert (e["ar"].size, e["ar"].bytes_sent, e["ar"].bytes_recv) == (S, 2 * (n - 1) * S // n, 2 * (n - 1) * S // n)
        S = n * 5 * 8
        assert (e["ag"].size, e["ag"].bytes_sent, e["ag"].bytes_recv) == (S, (n - 1) * 5 * 8, (n - 1) * 5 * 8)
        S = n * 7 * 2
        assert (e["rs"].size, e["rs"].bytes_sent) == (S, (n - 1) * 7 * 2)
        S = n * 3 * 2 * 4
        assert (e["a2a"].size, e["a2a"].bytes_sent, e["a2a"].bytes_recv) == (S, (n - 1) * S // n, (n - 1) * S // n)
        assert e["a2a"].algorithm == "pairwise" and e["ar"].algorithm == "ring"
        # chain broadcast rooted at n-1: every rank but the last of the chain sends S,
        # every rank but the root receives S
        hop = (r - (n - 1)) % n
        assert e["bc"].bytes_sent == (36 if (n > 1 and hop < n - 1) else 0)
        assert e["bc"].bytes_recv == (36 if hop > 0 else 0)
        assert e["red"].bytes_recv == (36 if (n > 1 and r != n - 1) else 0)
        assert e["red"].bytes_sent == (36 if r != 0 else 0)
        assert e["sc"].bytes_sent == ((n - 1) * 16 if r == 0 else 0) and e["sc"].bytes_recv == (16 if r else 0)
        assert e["ga"].bytes_recv == ((n - 1) * 16 if r == 0 else 0) and e["ga"].bytes_sent == (16 if r else 0)
        assert e["bar"].bytes_sent == 0
        if n > 1 and r in (0, 1):
            assert e["p2p"].op == ("send" if r == 0 else "recv")
            assert e["p2p"].group == (0, 1) and e["p2p"].size == 88
            assert (e["p2p"].bytes_sent, e["p2p"].bytes_recv) == ((88, 0) if r == 0 else (0, 88))
    # ring totals over the group: each byte sent is received
    for label in ("ar", "ag", "rs", "a2a", "bc", "red", "sc", "ga", "p2p"):
        sent = sum(x.bytes_sent for x in led.entries if x.label == label)
        recv = sum(x.bytes_recv for x in led.entries if x.label == label)
        assert sent == recv, label


def test_uneven_all_to_all_counts_exact_chunks():
    def fn(world):
        p, n = world.rank, world.size
        ins = [(p + 2 * j) % 3 for j in range(n)]
        outs = [(j + 2 * p) % 3 for j in range(n)]
        world.all_to_all(torch.zeros(sum(outs), 4), torch.zeros(sum(ins), 4), out_splits=outs, in_splits=ins)
    led = launch(fn, 5).ledger
    for p in range(5):
        e = led.for_rank(p)[0]
        ins = [(p + 2 * j) % 3 for j in range(5)]
        outs = [(j + 2 * p) % 3 for j in range(5)]
        assert e.bytes_sent == 16 * (sum(ins) - ins[p])
        assert e.bytes_recv == 16 * (sum(outs) - outs[p])


def test_entries_record_group_label_site_and_order():
    led = launch(all_ops, 4, args=("mesh", "float32")).ledger
    e0 = led.for_rank(0)
    assert [e.index for e in e0] == list(range(len(e0)))
    first = e0[0]
    assert first.group == (0, 2) and first.label == "ar-SUM" and first.dtype == "float32"
    assert str(first.site).startswith("programs.py:") and first.to_dict()["site"] == str(first.site)
    assert first.shape == (3, 5)
    totals = led.totals("op")[0]
    assert totals["all_reduce"].calls == 6  # five reduce ops and the async one
    assert "rank" in led.table("op").splitlines()[0]


def test_bandwidth_follows_nccl_tests():
    e = LedgerEntry(rank=0, index=0, op="all_reduce", group=(0, 1, 2, 3), label="x", dtype="float32", shape=(10,),
                    size=1000, algorithm="ring", bytes_sent=1500, bytes_recv=1500, start=1.0, end=3.0)
    assert e.algbw == 500.0 and e.busbw == 500.0 * 2 * 3 / 4
    assert bus_factor("all_gather", 8) == Fraction(7, 8)
    assert bus_factor("broadcast", 8) == 1
    assert LedgerEntry(**{**e.to_dict(), "start": None, "group": (0, 1)}).busbw is None


def test_object_collectives_count_their_pickled_size():
    def fn(world):
        world.broadcast_object(list(range(100)) if world.rank == 0 else None, src=0, label="bo")
    led = launch(fn, 3).ledger
    sizes = {e.size for e in led.entries}
    assert len(sizes) == 1 and sizes.pop() > 100
    assert led.for_rank(0)[0].bytes_recv == 0 and led.for_rank(2)[0].bytes_sent == 0
