"""The pipeline bubble measured on the simulated clock: one step of a
pipeline layout on simulated ranks, each compute action charged a fixed cost per stage
(so the stages cost the same), every send and receive timed by the cost model. The
bubble is the fraction of the step a rank is not computing: 1 − m·(F + B) / step. Also
returns each rank's peak activation memory, measured as autograd saves tensors."""
from __future__ import annotations

from collectives import launch
from simulator import SimulatedTime

from .data import MarkovSource
from .rank_program import RankProgram
from .run_config import RunConfig

UNIT = 1e-3  # seconds: one forward of a whole stage
COSTS = {"F": UNIT, "B": 2 * UNIT, "I": UNIT, "W": UNIT}


def _rank(world, run, costs):
    rank = RankProgram(world, run, "cpu")
    world.timing.compute_model.unit_costs = costs  # each pipeline action charged its fixed cost
    cfg, layout = run.model, run.layout
    batch = MarkovSource(cfg.vocab_size, seed=run.seed).global_batch(0, layout.global_batch, cfg.seq_len)
    clock = world.timing.clock
    t0, b0 = clock.now, clock.bubble
    rank.forward_backward(rank.microbatches(rank.local(batch)))
    return clock.now - t0, rank.memory.peak_activations, clock.bubble - b0


def measure(run: RunConfig, costs=None) -> dict:
    """{"step": seconds, "bubble": fraction, "peak_activations": [bytes per rank], "ledger",
    "clock_bubble": [fraction per rank: the clock's idle on pipeline calls over the step]}."""
    costs = costs or COSTS
    run.layout.validate(run.model)
    res = launch(_rank, run.layout.world, args=(run, costs), time_model=SimulatedTime(run.hardware or "h100-sxm"))
    step = max(t for t, _, _ in res.values)
    busy = run.layout.microbatches * costs["F"] + run.layout.microbatches * (
        costs["I"] + costs["W"] if run.layout.schedule == "zb1" else costs["B"])
    return {"step": step, "bubble": 1 - busy / step, "peak_activations": [a for _, a, _ in res.values],
            "ledger": res.ledger, "clock_bubble": [b / step for _, _, b in res.values]}


def theory(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble fraction of the papers, F = B/2 (and I = W = F for ZB-H1, whose bubble
    is (p − 1) forwards: a third of 1F1B's (p − 1)(F + B))."""
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


__all__ = ["measure", "theory", "COSTS", "UNIT"]
