"""The front door: `Layout`, the training loop, the equivalence check, reports, the command."""
from .layout import Layout, LayoutError
from .run_config import RunConfig

__all__ = ["Layout", "LayoutError", "RunConfig", "train", "check"]


def train(run, collect=False):
    from .train import train as _train
    return _train(run, collect)


def check(run):
    from .check import check as _check
    return _check(run)
