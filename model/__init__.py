"""The reference transformer, its configs and presets, initialisation and data sources."""
from .config import DEFAULT_LR, PRESETS, GPTConfig, preset
from .gpt import GPT
from .init import init_full_parameter

__all__ = ["DEFAULT_LR", "GPT", "GPTConfig", "PRESETS", "preset", "init_full_parameter"]
