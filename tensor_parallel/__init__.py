"""Megatron tensor parallelism with sequence parallelism and a vocabulary-parallel loss,
applied to the reference GPT by module swaps (`parallelize_tensor`)."""
from .cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear
from .mappings import copy_to_tp, gather_seq, reduce_from_tp, scatter_seq
from .plan import check_tensor_parallel, parallelize_tensor

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelCrossEntropy",
           "vocab_parallel_cross_entropy", "copy_to_tp", "reduce_from_tp", "gather_seq", "scatter_seq",
           "parallelize_tensor", "check_tensor_parallel"]
