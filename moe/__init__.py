"""Expert parallelism: the experts of the reference's MoE layers (model/moe.py) sharded
over an expert-parallel group, tokens dispatched to them and combined back over uneven
all-to-alls (`parallelize_experts`)."""
from .dispatch import ExpertParallelDispatch, all_to_all
from .plan import expert_parameters, parallelize_experts

__all__ = ["ExpertParallelDispatch", "all_to_all", "parallelize_experts", "expert_parameters"]
