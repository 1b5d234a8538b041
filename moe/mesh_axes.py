"""The expert mesh (GShard's expert-parallel groups, Lepikhin et al. 2020): the layout's
ranks with dp × cp seen as (edp, ep). No torch here: the planner reads it for placements."""
from __future__ import annotations


def expert_mesh_axes(layout) -> dict:
    """The mesh axes with dp × cp seen as (edp, ep): expert-parallel groups of ep neighbouring
    dp × cp ranks, and the expert-data-parallel groups across them."""
    ep = max(1, layout.ep)
    return {"pp": layout.pp, "edp": layout.dp * layout.cp // ep, "ep": ep, "tp": layout.tp}
