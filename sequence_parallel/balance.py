"""Which tokens of the sequence a context-parallel rank holds (Brandon et al. 2023,
"Striped Attention", and the zig-zag layout of ring-flash-attention and torch's head-tail
load balancer).

- `contiguous`: the sequence cut into cp chunks, rank r holds chunk r. Under a causal mask
  rank r attends to r + 1 of the cp key blocks: the last rank does cp times the first's
  work, and the others wait for it.
- `zigzag` (the default): the sequence cut into 2·cp chunks, rank r holds chunks r and
  2·cp − 1 − r (a head and a tail), so every rank does the same causal work.

The tokens, their RoPE positions and the targets are all taken in this order, so the loss
is still the mean over every token of the sequence.
"""
from __future__ import annotations

BALANCES = ("zigzag", "contiguous")
IMPLEMENTATIONS = ("ring", "ulysses")  # sequence_parallel.plan


def chunks_of(rank: int, cp: int, balance: str) -> list:
    """The chunk indices rank holds, in the order it holds them."""
    if balance == "zigzag":
        return [rank, 2 * cp - 1 - rank]
    if balance == "contiguous":
        return [rank]
    raise ValueError(f"cp balance {balance!r}: choose one of {BALANCES}")


def n_chunks(cp: int, balance: str) -> int:
    return 2 * cp if balance == "zigzag" else cp


def check_sequence(seq_len: int, cp: int, balance: str) -> None:
    """Raise ValueError naming the numbers when seq_len does not split into the chunks."""
    n = n_chunks(cp, balance)
    if seq_len % n:
        lengths = [seq_len - seq_len % n, seq_len - seq_len % n + n]
        cps = [c for c in range(1, seq_len + 1) if seq_len % n_chunks(c, balance) == 0]
        what = "2·cp" if balance == "zigzag" else "cp"
        raise ValueError(f"seq_len={seq_len} is not divisible by {what} = {n} ({balance} cuts the sequence into {n} "
                         f"chunks); seq_len could be {' or '.join(str(x) for x in lengths if x > 0)}, or cp one of "
                         f"{cps[:12]}")


def positions(seq_len: int, cp: int, rank: int, balance: str) -> list:
    """The global positions of the tokens rank holds, in its order."""
    check_sequence(seq_len, cp, balance)
    c = seq_len // n_chunks(cp, balance)
    return [i for k in chunks_of(rank, cp, balance) for i in range(k * c, (k + 1) * c)]
