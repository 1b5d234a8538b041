"""What Megatron tensor parallelism (Shoeybi et al. 2019) and its sequence parallelism
(Korthikanti et al. 2022) need of a model and a layout: the heads, the key/value heads and
the MLP's width split over tp, the sequence split over tp under sequence parallelism, and MoE
blocks routed per sequence slice. `problem` names the numbers that disagree (or None); the
layout's validation and `parallelize_tensor` both ask it. No torch here: the command line
checks a layout before importing it."""
from __future__ import annotations

from model.config import divisors


def problem(config, tp: int, sequence_parallel: bool, cp: int = 1) -> str | None:
    c = config
    if tp > 1 and c.n_heads % tp:
        return f"n_heads={c.n_heads} is not divisible by tp={tp}; tp could be one of {divisors(c.n_heads)}"
    if tp > 1 and c.kv_heads % tp:
        return (f"n_kv_heads={c.kv_heads} is not divisible by tp={tp} (tensor parallelism splits the key/value heads "
                f"too); tp could be one of {divisors(c.kv_heads)}")
    if tp > 1 and c.d_ff % tp:
        return (f"d_ff={c.d_ff} is not divisible by tp={tp}; "
                f"tp could be one of {[d for d in divisors(c.d_ff) if c.n_heads % d == 0]}")
    if sequence_parallel and tp == 1:
        return "sequence_parallel needs tp > 1"
    if sequence_parallel and c.seq_len % tp:
        return f"sequence parallelism splits seq_len={c.seq_len} over tp={tp}: not divisible"
    if sequence_parallel and cp > 1 and (c.seq_len // cp) % tp:
        return (f"sequence parallelism splits each cp rank's seq_len/cp = {c.seq_len // cp} tokens over tp={tp}: "
                f"not divisible")
    if c.n_experts and tp > 1 and not sequence_parallel:
        return (f"tp={tp} with experts needs --sp: each TP rank then routes its slice of the sequence, so no token "
                f"reaches the experts twice")
    return None
