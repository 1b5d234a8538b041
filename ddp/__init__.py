"""Data parallelism: bucketed gradient all-reduce overlapped with backward, `no_sync`."""
from .ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
