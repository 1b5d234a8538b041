"""Activation checkpointing: each transformer block recomputes in backward what it did not
keep in forward, fully (Chen et al. 2016) or selectively (Korthikanti et al. 2022; and
torchtitan's op-level policy, which recomputes every second matmul too): `checkpoint_blocks`. Names are loaded on first use (PEP 562),
so that the command line reads MODES without importing torch."""
import importlib

MODES = ("none", "full", "selective", "selective-op")

_EXPORTS = {"Recompute": "checkpoint", "checkpoint_blocks": "checkpoint", "SelectivePolicy": "policy",
            "KEEP": "policy"}
__all__ = ["MODES"] + list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
