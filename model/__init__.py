"""The reference transformer, its configs and presets, initialisation, and the three things
every strategy shares about it, which live here because strategies never import one another
and this is the one package below them all: where a local tensor sits in it (`placement`),
when gradients are ready during backward (`grad_hooks`, DDP's and ZeRO's), and the regions
of its arithmetic the simulator prices as one kernel (`regions`). Data sources are the
training loop's (playground/data.py); AdamW is ZeRO's (zero/optimizer.py).

Names are loaded on first use (PEP 562), so that `playground --help` reads the presets
without importing torch."""
import importlib

_EXPORTS = {
    "DEFAULT_LR": "config", "PRESETS": "config", "GPTConfig": "config", "preset": "config",
    "GPT": "gpt", "init_full_parameter": "init", "init_weights": "init",
    "Placement": "placement", "Shard": "placement", "Flat": "placement", "assemble": "placement",
    "placement_of": "placement", "set_placement": "placement",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
