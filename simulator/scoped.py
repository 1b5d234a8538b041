"""An attribute set for a block and restored after it: the dispatch modes' switches that
model/regions.py turns on around a region (simulator/compute_model.py, simulator/memory.py)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def scoped(obj, attr: str, value):
    """`obj.attr` is `value` inside the block, what it was before after it; yields obj."""
    before = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield obj
    finally:
        setattr(obj, attr, before)
