"""What a pipeline (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2021; ZB-H1, Qi et al.
2023) needs of a model and a layout: the blocks split into pp·virtual_stages stages, a
schedule that exists for its microbatch count. `problem` names the numbers that disagree
(or None). No torch here."""
from __future__ import annotations

from model.config import divisors

from .schedules import SCHEDULES, ScheduleError, build_schedule


def problem(config, pp: int, schedule: str, microbatches: int, virtual_stages: int = 1,
            stage_layers=None) -> str | None:
    c, stages = config, pp * virtual_stages
    if stage_layers is not None:
        inner = list(stage_layers)[1:-1]
        if len(stage_layers) != stages or sum(stage_layers) != c.n_layers or min(stage_layers) < 0 or \
                (inner and min(inner) < 1):
            return (f"stage_layers={list(stage_layers)}: give {stages} block counts (pp·virtual_stages) summing to "
                    f"n_layers={c.n_layers}, each positive but the first and the last (which may hold only the "
                    f"embedding, or only the head and the loss)")
    elif c.n_layers % stages:
        return (f"n_layers={c.n_layers} is not divisible by pp·virtual_stages = {pp}·{virtual_stages} = {stages}; "
                f"stage counts that fit: {divisors(c.n_layers)}")
    if schedule not in SCHEDULES:
        return f"schedule={schedule!r}: choose one of {SCHEDULES}"
    if virtual_stages > 1 and schedule != "interleaved":
        return f"virtual_stages={virtual_stages} needs schedule='interleaved', got {schedule!r}"
    if pp > 1:
        try:  # the schedule says which microbatch counts it allows
            build_schedule(schedule, pp, microbatches, virtual_stages)
        except ScheduleError as e:
            return f"pp={pp}, schedule {schedule!r}: {e}"
    return None

