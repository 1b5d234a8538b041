"""The process-group layer: `launch`, `ProcessGroup`, `Mesh`, the simulated and torch
backends, and the byte ledger. See docs/architecture.md, Contracts 1 and 2."""
from .errors import (CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, DeadlockError, RankAbortedError,
                     RankFailedError)
from .launch import LaunchResult, launch
from .ledger import Ledger, LedgerEntry
from .mesh import Mesh
from .process_group import P2POp, ProcessGroup, Work
from .reduce_op import ReduceOp

__all__ = [
    "launch", "LaunchResult", "ProcessGroup", "Work", "P2POp", "Mesh", "ReduceOp", "Ledger", "LedgerEntry",
    "CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError", "DeadlockError", "RankAbortedError",
    "RankFailedError",
]
