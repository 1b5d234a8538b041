"""Errors of the process-group layer.

A distributed program that goes wrong on NCCL usually hangs for the watchdog's half
hour. The simulated backend sees every rank at once, so it fails at once instead, with a
message naming every rank and call involved.
"""


class CollectiveError(RuntimeError):
    """Base class of every error raised by the process-group layer."""


class CollectiveMismatchError(CollectiveError):
    """Ranks of one group issued different collectives (op, shape, dtype, root,
    reduce op, label or splits) at the same point of their program."""


class DeadlockError(CollectiveError):
    """Every live rank is blocked and nothing can make progress."""


class CollectiveTimeoutError(CollectiveError):
    """A rank waited in a collective longer than the timeout (NCCL's watchdog): some member
    never arrived, hung outside any call. The message names the ranks waiting, the call
    each waits in, and those that never arrived."""


class RankAbortedError(CollectiveError):
    """Raised inside a rank because another rank failed; `launch` reports the
    original failure instead."""


class RankFailedError(CollectiveError):
    """`launch` raises this when a rank raised: it names the rank and carries the
    original traceback as text (and as `__cause__`)."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):  # (pickled across processes: a worker's failure reaches its parent whole)
        return type(self), (self.rank, str(self))
