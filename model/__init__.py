"""The reference transformer, its configs and presets, initialisation, data sources, and
the two things every strategy shares about it: where a local tensor sits in it
(`placement`) and when gradients are ready during backward (`grad_hooks`)."""
from .config import DEFAULT_LR, PRESETS, GPTConfig, preset
from .gpt import GPT
from .init import init_full_parameter, init_weights
from .placement import Flat, Placement, Shard, assemble, placement_of, set_placement

__all__ = ["DEFAULT_LR", "GPT", "GPTConfig", "PRESETS", "preset", "init_full_parameter", "init_weights",
           "Placement", "Shard", "Flat", "assemble", "placement_of", "set_placement"]
