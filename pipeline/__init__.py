"""Pipeline parallelism: the stage split (pruning the reference model), schedules as
data, one executor. Names are loaded on first use (PEP 562): the schedules need no torch."""
import importlib

_EXPORTS = {
    "PipelineExecutor": "executor", "partition": "split", "prune": "split", "split_stages": "split",
    "Action": "schedules", "ScheduleError": "schedules", "SCHEDULES": "schedules", "build_schedule": "schedules",
    "fewest_microbatches": "schedules",
    "makespan": "schedules", "table": "schedules",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
