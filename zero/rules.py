"""What data parallelism's ZeRO engine (Rajbhandari et al. 2019) and hybrid sharding (Zhao
et al. 2023, FSDP's HYBRID_SHARD) need of a layout and a run, and the model states a rank
holds under them (`model_state_bytes`, the one formula the capacity estimate and the search
use). No torch here."""
from __future__ import annotations

from model.config import divisors

STAGES = (0, 1, 2, 3)


def problem(zero: int, dp: int, dp_replicate: int = 1) -> str | None:
    if zero not in STAGES:
        return f"zero={zero}: choose 0, 1, 2 or 3"
    if dp % dp_replicate:
        return f"dp_replicate={dp_replicate} does not divide dp={dp}; it could be one of {divisors(dp)}"
    if dp_replicate > 1 and not zero:
        return (f"dp_replicate={dp_replicate}: hybrid sharding replicates ZeRO's shards; without --zero every "
                f"parameter is replicated already (DDP): add --zero 1, 2 or 3")
    return None


def run_problem(zero: int, dtype: str, reduce_dtype: str | None, grad_overlap: bool) -> str | None:
    if reduce_dtype is not None and not zero and dtype != "float16":
        return f"--reduce-dtype {reduce_dtype} applies to ZeRO's gradient reductions: add --zero 1|2|3"
    if not grad_overlap and zero >= 2:
        return (f"--no-grad-overlap: ZeRO-{zero} reduces each unit's gradient as its backward ends; reducing after "
                f"the backward needs --zero 0 or 1")
    return None


def model_state_bytes(params: float, zero: int, shard: int, width: int, compute_width: int | None = None) -> float:
    """Bytes of model states a rank holds for `params` parameters under ZeRO stage `zero` over
    a shard group of `shard` ranks: weights and gradients of `width` bytes and AdamW's two
    moments, each sharded from its stage on (optimizer states from 1, gradients from 2,
    weights at 3). With `compute_width` (mixed precision: compute copies of that width beside
    `width`-byte master weights), the master weights count with the optimizer states, the
    gradients are in the compute width, and stage 3 keeps no compute copy (each all-gather
    casts the master shard: zero/zero.py)."""
    def part(stage):  # the fraction of a state sharded from `stage` on
        return 1 / shard if zero >= stage else 1
    if compute_width is None:
        return params * width * (part(3) + part(2) + 2 * part(1))
    copies = 0 if zero >= 3 else compute_width
    return params * (copies + compute_width * part(2) + 3 * width * part(1))
