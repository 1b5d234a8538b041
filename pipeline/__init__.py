"""Pipeline parallelism: stage partitioning, schedules as data, one executor."""
from .executor import PipelineExecutor
from .schedules import SCHEDULES, Action, ScheduleError, build_schedule, makespan, table
from .stage import PipelineStage, partition

__all__ = ["PipelineExecutor", "PipelineStage", "partition", "Action", "ScheduleError", "SCHEDULES",
           "build_schedule", "makespan", "table"]
