"""Pipeline parallelism: the stage split (pruning the reference model), schedules as
data, one executor."""
from .executor import PipelineExecutor
from .schedules import SCHEDULES, Action, ScheduleError, build_schedule, makespan, table
from .split import partition, prune, split_stages

__all__ = ["PipelineExecutor", "partition", "prune", "split_stages", "Action", "ScheduleError", "SCHEDULES",
           "build_schedule", "makespan", "table"]
