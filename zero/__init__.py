"""ZeRO-1/2/3 and hybrid sharding: sharded optimizer states, gradients and parameters
(zero.py), and what they need and hold (rules.py). Names are loaded on first use (PEP 562):
the rules and the memory formula are read without torch."""
import importlib

_EXPORTS = {"DynamicLossScaler": "loss_scaler", "ZeroDataParallel": "zero", "model_state_bytes": "rules"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
