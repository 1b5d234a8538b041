"""Megatron tensor parallelism with sequence parallelism and a vocabulary-parallel loss,
applied to the reference GPT by module swaps (`parallelize_tensor`). Names are loaded on
first use (PEP 562): what the layout needs (`rules`) is checked without torch."""
import importlib

_EXPORTS = {
    "VocabParallelCrossEntropy": "cross_entropy", "vocab_parallel_cross_entropy": "cross_entropy",
    "VocabParallelEmbedding": "embedding", "ColumnParallelLinear": "layers", "RowParallelLinear": "layers",
    "copy_to_tp": "mappings", "gather_seq": "mappings", "reduce_from_tp": "mappings", "scatter_seq": "mappings",
    "check_tensor_parallel": "plan", "parallelize_tensor": "plan",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
