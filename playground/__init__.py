"""The front door: `Layout`, `parallelize`, the training loop (`train`), the equivalence
check (`check`), reports, the command. Names are loaded on first use (PEP 562), so that
the command's `--help` answers without importing torch."""
import importlib

_EXPORTS = {"Layout": "layout", "LayoutError": "layout", "RunConfig": "run_config",
            "parallelize": "parallelize", "ParallelModel": "parallelize",
            "train": "training", "TrainResult": "training", "check": "equivalence", "CheckReport": "equivalence"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
