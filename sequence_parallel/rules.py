"""What context parallelism needs of a model and a layout: ring attention (Liu et al. 2023)
cuts the sequence into cp chunks (2·cp under the zig-zag balance) and runs the flash kernel;
Ulysses (Jacobs et al. 2023) splits the key/value heads over cp. `problem` names the
numbers that disagree (or None). No torch here."""
from __future__ import annotations

from model.config import divisors

from .balance import BALANCES, IMPLEMENTATIONS, n_chunks


def problem(config, cp: int, impl: str, balance: str, tp: int = 1) -> str | None:
    c = config
    if impl not in IMPLEMENTATIONS:
        return f"cp_impl={impl!r}: choose one of {IMPLEMENTATIONS}"
    if balance not in BALANCES:
        return f"cp_balance={balance!r}: choose one of {BALANCES}"
    if cp == 1:
        return None
    if c.attention != "flash":
        return (f"cp={cp} needs attention='flash' (ring attention and Ulysses run the flash kernel; "
                f"attention={c.attention!r} would be silently replaced)")
    n = n_chunks(cp, balance)
    if c.seq_len % n:
        what = "2·cp" if balance == "zigzag" else "cp"
        fits = [d for d in divisors(c.seq_len) if d == 1 or c.seq_len % n_chunks(d, balance) == 0]  # (cp 1 cuts nothing)
        return (f"seq_len={c.seq_len} is not divisible by {what} = {n} ({balance} cuts the sequence into {n} "
                f"chunks); cp could be one of {fits}, or seq_len a multiple of {n}")
    if impl == "ulysses" and c.kv_heads % (cp * tp):
        heads = "n_heads" if c.kv_heads == c.n_heads else "n_kv_heads"
        return (f"Ulysses splits the heads over cp: {heads}={c.kv_heads} is not divisible by cp·tp = {cp}·{tp} = "
                f"{cp * tp}; cp could be one of {divisors(c.kv_heads // tp)}")
    return None
