"""Expert parallelism: the experts of the reference's MoE layers (model/moe.py) sharded
over an expert-parallel group, tokens dispatched to them and combined back over uneven
all-to-alls (`parallelize_experts`), and the transform the composition applies
(`parallelize_moe`). Names are loaded on first use (PEP 562): what the layout needs
(`rules`, `expert_mesh_axes`) is read without torch."""
import importlib

_EXPORTS = {
    "ExpertParallelDispatch": "dispatch", "all_to_all": "dispatch",
    "AuxLosses": "plan", "ExpertShards": "plan", "MoEParallel": "plan", "expert_parameters": "plan",
    "parallelize_experts": "plan", "parallelize_moe": "plan", "expert_mesh_axes": "mesh_axes",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
