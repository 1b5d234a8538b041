"""The reference transformer, its configs and presets, initialisation and data sources."""
from .config import PRESETS, GPTConfig, preset
from .gpt import GPT
from .init import init_full_parameter

__all__ = ["GPT", "GPTConfig", "PRESETS", "preset", "init_full_parameter"]
