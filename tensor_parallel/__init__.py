"""Megatron tensor parallelism with sequence parallelism and a vocabulary-parallel loss."""
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .mappings import copy_to_tp, gather_seq, reduce_from_tp, scatter_seq
from .model import ParallelGPT

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "copy_to_tp", "reduce_from_tp", "gather_seq", "scatter_seq", "ParallelGPT"]
