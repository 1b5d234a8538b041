"""Alpha-beta cost of each collective on a topology (Hockney 1994; Thakur, Rabenseifner &
Gropp 2005, "Optimization of Collective Communication Operations in MPICH").

A transfer of n bytes over a link costs α + n·β (α: latency per step, β: seconds per
byte = 1 / bandwidth). For a group of p ranks and a message of S bytes (nccl-tests
definition, see algorithms.py):
- ring all_reduce: 2(p-1)·α + 2(p-1)/p·S·β
- ring all_gather, reduce_scatter; pairwise all_to_all; direct scatter, gather:
  (p-1)·α + (p-1)/p·S·β
- recursive doubling all_reduce (small messages): ⌈log2 p⌉·α + ⌈log2 p⌉·S·β
- pipelined chain broadcast, reduce: (p-1)·α + S·β
- send / recv: α + S·β
Where the group sits decides the link: all ranks in one node use NVLink; one rank per
node uses the network; several ranks on each of several nodes use a hierarchical
algorithm (inside the node, then across nodes, then inside again): all_reduce =
reduce_scatter in the node + all_reduce of S/k across the m nodes + all_gather in the
node; all_gather (reduce_scatter mirrored) = all_gather of S/k across nodes + all_gather in
the node. Irregular spans fall back to a flat ring over the network. Ranks sit on nodes
in blocks of `gpus_per_node` (rank r on node r // gpus_per_node).

`algorithm="auto"` takes, for all_reduce, the cheaper of recursive doubling and the ring
(or the hierarchical algorithm, for groups over several nodes), as NCCL switches to a
tree for small messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Hardware


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per step
    beta: float  # seconds per byte


def nvlink(hw: Hardware) -> Link:
    return Link(hw.nvlink_latency, 1.0 / hw.nvlink_bandwidth)


def network(hw: Hardware) -> Link:
    return Link(hw.network_latency, 1.0 / hw.network_bandwidth)


# -- flat algorithms on one kind of link -------------------------------------------------------
def ring_all_reduce(p: int, S: float, link: Link) -> float:
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * S * link.beta


def ring_all_gather(p: int, S: float, link: Link) -> float:
    """Also reduce_scatter, pairwise all_to_all, direct scatter and gather."""
    return (p - 1) * link.alpha + (p - 1) / p * S * link.beta


def recursive_doubling_all_reduce(p: int, S: float, link: Link) -> float:
    steps = math.ceil(math.log2(p))
    return steps * link.alpha + steps * S * link.beta


def chain_broadcast(p: int, S: float, link: Link) -> float:
    """Also reduce: a pipelined chain, every link carrying S."""
    return (p - 1) * link.alpha + S * link.beta


def point_to_point(S: float, link: Link) -> float:
    return link.alpha + S * link.beta


# -- placement -----------------------------------------------------------------------------------
def placement(ranks, gpus_per_node: int) -> tuple[int, int, bool]:
    """(nodes spanned, ranks per node, regular: every spanned node holds the same count)."""
    counts: dict = {}
    for r in ranks:
        counts[r // gpus_per_node] = counts.get(r // gpus_per_node, 0) + 1
    per_node = set(counts.values())
    return len(counts), max(per_node), len(per_node) == 1


_GATHER_LIKE = ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather", "all_gather_object")


def collective_cost(op: str, size: float, ranks, hw: Hardware, algorithm: str = "auto") -> tuple[float, str]:
    """(seconds, algorithm) of one call of `op` with message size `size` bytes on the
    group of global `ranks`."""
    p = len(ranks)
    if op in ("send", "recv"):
        m, _, _ = placement(ranks, hw.gpus_per_node)
        return point_to_point(size, nvlink(hw) if m == 1 else network(hw)), "p2p"
    if p <= 1:
        return 0.0, "none"
    if op == "barrier":
        op, size, algorithm = "all_reduce", 0.0, "recursive_doubling"
    m, k, regular = placement(ranks, hw.gpus_per_node)
    link = nvlink(hw) if m == 1 else network(hw)
    if m > 1 and k > 1 and regular and op in ("all_reduce", "all_gather", "reduce_scatter") and algorithm in ("auto", "hierarchical"):
        hier = _hierarchical(op, size, m, k, hw)
        if algorithm == "auto" and op == "all_reduce" and recursive_doubling_all_reduce(p, size, link) < hier:
            return recursive_doubling_all_reduce(p, size, link), "recursive_doubling"
        return hier, "hierarchical"
    if op == "all_reduce":
        ring = ring_all_reduce(p, size, link)
        rd = recursive_doubling_all_reduce(p, size, link)
        if algorithm == "recursive_doubling" or (algorithm == "auto" and rd < ring):
            return rd, "recursive_doubling"
        return ring, "ring"
    if op in _GATHER_LIKE:
        name = {"all_to_all": "pairwise", "scatter": "direct", "gather": "direct"}.get(op, "ring")
        return ring_all_gather(p, size, link), name
    if op in ("broadcast", "reduce", "broadcast_object"):
        return chain_broadcast(p, size, link), "chain"
    raise ValueError(f"no cost formula for op {op!r}")


def bytes_per_rank(op: str, algorithm: str, S: int, ranks, hw: Hardware):
    """(sent, received) by each rank under `algorithm` where it differs from the ring
    (algorithms.py); None where the ring's bytes stand. Recursive doubling exchanges the
    whole S at each of ⌈log2 p⌉ steps; hierarchical moves the intra-node ring's share of S
    plus the inter-node share of S/k (per rank: 2(k-1)/k·S + 2(m-1)/m·S/k for all_reduce,
    (k-1)/k·S + (m-1)/m·S/k for all_gather and reduce_scatter)."""
    p = len(ranks)
    if algorithm == "recursive_doubling":
        b = math.ceil(math.log2(p)) * S
        return b, b
    if algorithm == "hierarchical":
        m, k, _ = placement(ranks, hw.gpus_per_node)
        if op == "all_reduce":
            b = 2 * (k - 1) * S // k + 2 * (m - 1) * (S // k) // m
        else:
            b = (k - 1) * S // k + (m - 1) * (S // k) // m
        return b, b
    return None


def _hierarchical(op: str, S: float, m: int, k: int, hw: Hardware) -> float:
    intra, inter = nvlink(hw), network(hw)
    if op == "all_reduce":
        return 2 * ring_all_gather(k, S, intra) + ring_all_reduce(m, S / k, inter)
    return ring_all_gather(m, S / k, inter) + ring_all_gather(k, S, intra)


# -- links -------------------------------------------------------------------------------------
def sent_across_nodes(op: str, algorithm: str, S: int, ranks, rank: int, sent: int, gpus_per_node: int) -> int:
    """Of the `sent` bytes `rank` moved in one call on the group `ranks`, those that left its
    node (the rest stayed on NVLink). A ring (and a chain) sends to the next rank in group
    order, a point-to-point call to its peer: all of it crosses or none. Hierarchical moves
    only its inter-node share across (2(m-1)/m·S/k for all_reduce, (m-1)/m·S/k otherwise),
    recursive doubling the exchanges whose partner sits on another node."""
    node = rank // gpus_per_node
    if all(r // gpus_per_node == node for r in ranks) or sent == 0:
        return 0
    p, i = len(ranks), list(ranks).index(rank)
    if algorithm == "hierarchical":
        m, k, _ = placement(ranks, gpus_per_node)
        return 2 * (m - 1) * (S // k) // m if op == "all_reduce" else (m - 1) * (S // k) // m
    if algorithm == "recursive_doubling":
        steps = math.ceil(math.log2(p))
        off = sum(1 for j in range(steps) if (i ^ (1 << j)) >= p or ranks[i ^ (1 << j)] // gpus_per_node != node)
        return sent * off // steps
    if op in ("send", "recv") or algorithm == "p2p":
        peer = ranks[1 - i] if p == 2 else ranks[(i + 1) % p]
    else:  # the ring, the chain: to the next rank in group order
        peer = ranks[(i + 1) % p]
    return sent if peer // gpus_per_node != node else 0
