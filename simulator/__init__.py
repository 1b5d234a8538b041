"""The simulator: the time and memory model of a simulated run. Hardware profiles, the
alpha-beta cost model of collectives, the roofline compute model, the per-rank clock
with record and replay, memory accounting by category, and Chrome traces. It plugs into
the process-group layer through `collectives.timing.TimeModel` (`SimulatedTime`).

Names are loaded on first use (PEP 562): the command checks a --hardware profile without
importing torch."""
import importlib

_EXPORTS = {"Hardware": "hardware", "PROFILES": "hardware", "load_hardware": "hardware",
            "MemoryTracker": "memory", "SimulatedTime": "time_model"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
