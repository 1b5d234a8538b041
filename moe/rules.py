"""What expert parallelism (GShard, Lepikhin et al. 2020) needs of a model and a layout:
experts to shard, and ep dividing both the experts and the data-parallel ranks its groups
are carved from. `problem` names the numbers that disagree (or None). No torch here."""
from __future__ import annotations

from model.config import divisors


def problem(config, ep: int, dp: int, cp: int = 1) -> str | None:
    c = config
    if ep > 1 and not c.n_experts:
        return (f"ep={ep} shards experts, and the model has none (n_experts=0): choose an MoE preset (tiny-moe, "
                f"small-moe, 1b-moe, tiny-dsmoe, 1b-dsmoe) or give --experts")
    if ep > 1 and (dp * cp) % ep:
        return (f"ep={ep} must divide dp·cp = {dp}·{cp} = {dp * cp} (expert-parallel groups are carved from the "
                f"data-parallel ranks); ep could be one of {divisors(dp * cp)}")
    if ep > 1 and c.n_experts % ep:
        return (f"n_experts={c.n_experts} is not divisible by ep={ep}; ep could be one of "
                f"{[d for d in divisors(c.n_experts) if (dp * cp) % d == 0]}")
    return None

