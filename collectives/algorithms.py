"""Message sizes and per-rank bytes of each collective, as real hardware would move them.

Message size S follows nccl-tests (doc/PERFORMANCE.md in NVIDIA/nccl-tests):
all_reduce, broadcast, reduce, send/recv: the bytes of the buffer; all_gather, gather:
the bytes of the *output* (n inputs); reduce_scatter, scatter: the bytes of the *input*
(n outputs); all_to_all: the bytes of one rank's send buffer.

Bytes per rank under each algorithm (n = group size):
- ring all_reduce (Patarasuk & Yuan 2009): reduce-scatter then all-gather, each rank
  sends and receives 2(n-1)/n·S;
- ring all_gather / reduce_scatter: (n-1)/n·S;
- pairwise all_to_all: each rank sends every chunk but its own and receives likewise,
  (n-1)/n·S for even splits, the exact chunk sizes for uneven ones;
- chain (pipelined ring) broadcast / reduce: every link of the chain carries S, so a
  middle rank sends and receives S, the root only sends (broadcast) or receives (reduce);
- direct scatter / gather: the root sends (receives) the n-1 chunks of the others;
- send / recv: S.
busbw = algbw × factor, with the nccl-tests factors: 2(n-1)/n for all_reduce, (n-1)/n for
all_gather, reduce_scatter, all_to_all, gather, scatter; 1 for the rest.
"""
from __future__ import annotations

from fractions import Fraction


def bus_factor(op: str, n: int) -> Fraction:
    if n <= 1:
        return Fraction(0) if op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") else Fraction(1)
    if op == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "all_gather_object"):
        return Fraction(n - 1, n)
    return Fraction(1)


def ring_bytes(op: str, size: int, n: int, pos: int, root: int = 0) -> tuple[int, int]:
    """(sent, received) bytes of the rank at group position `pos` for a call of message
    size `size` bytes under the default algorithm of `op` (all_to_all excepted: it needs
    the splits, see `all_to_all_bytes`)."""
    if n <= 1 or op == "barrier":
        return 0, 0
    if op == "all_reduce":
        # 2(n-1) steps, each moving one of n chunks; chunks may differ by one element in
        # NCCL, we count the exact fraction rounded down per rank.
        b = 2 * (n - 1) * size // n
        return b, b
    if op in ("all_gather", "reduce_scatter", "all_gather_object"):
        b = (n - 1) * size // n
        return b, b
    # chain rooted at `root`: position along the chain
    hop = (pos - root) % n
    if op in ("broadcast", "broadcast_object"):
        return (size if hop < n - 1 else 0), (size if hop > 0 else 0)
    if op == "reduce":
        return (size if hop > 0 else 0), (size if hop < n - 1 else 0)
    chunk = size // n
    if op == "scatter":
        return ((n - 1) * chunk, 0) if pos == root else (0, chunk)
    if op == "gather":
        return (0, (n - 1) * chunk) if pos == root else (chunk, 0)
    raise ValueError(f"no byte formula for op {op!r}")


def algorithm_of(op: str) -> str:
    if op in ("send", "recv"):
        return "p2p"
    if op == "all_to_all":
        return "pairwise"
    if op in ("broadcast", "reduce", "broadcast_object"):
        return "chain"
    if op in ("scatter", "gather"):
        return "direct"
    if op == "barrier":
        return "none"
    return "ring"
