"""Expert parallelism: the experts of the reference's MoE layers (model/moe.py) sharded
over an expert-parallel group, tokens dispatched to them and combined back over uneven
all-to-alls (`parallelize_experts`), and the transform the composition applies
(`parallelize_moe`)."""
from .dispatch import ExpertParallelDispatch, all_to_all
from .plan import (AuxLosses, ExpertShards, MoEParallel, expert_mesh_axes, expert_parameters, parallelize_experts,
                   parallelize_moe)

__all__ = ["ExpertParallelDispatch", "all_to_all", "parallelize_experts", "parallelize_moe", "expert_parameters",
           "expert_mesh_axes", "ExpertShards", "AuxLosses", "MoEParallel"]
