"""Stage splitting of the reference GPT for pipeline parallelism (Huang et al. 2019,
"GPipe"; Narayanan et al. 2021): a stage holds a contiguous range of the blocks; the
first stage also the embedding, the last the final norm, the head and the loss.

A stage is the reference model *pruned* to the modules it owns (as torchtitan's pipeline
split does): the blocks are a ModuleDict keyed by their index, so every parameter keeps
its reference name (`blocks.5.attn.wq.weight` on whichever stage holds block 5), and the
pruned model's forward takes hidden states in (no embedding) or gives them out (no head).
Each rank holds `virtual_stages` stages (interleaved schedules): chunk c of rank r is
stage c·p + r. Split the meta-device model before any other transform: each chunk is a
deep copy, and a copy keeps no attribute or hook a later transform would attach.
"""
from __future__ import annotations

import copy


def partition(n_layers: int, n_stages: int, sizes=None) -> list:
    """[(first block, end)] per stage: even, or the given numbers of blocks per stage."""
    if sizes is None:
        if n_layers % n_stages:
            raise ValueError(f"n_layers={n_layers} does not split evenly over {n_stages} stages; give the blocks "
                             f"per stage (sizes) or a stage count that divides it")
        sizes = [n_layers // n_stages] * n_stages
    sizes = list(sizes)
    if len(sizes) != n_stages or sum(sizes) != n_layers or min(sizes) < 0:
        raise ValueError(f"stage sizes {sizes} must be {n_stages} non-negative counts summing to n_layers={n_layers}")
    out, lo = [], 0
    for n in sizes:
        out.append((lo, lo + n))
        lo += n
    return out


def prune(model, blocks: tuple, first: bool, last: bool):
    """Keep only blocks [blocks[0], blocks[1]), the embedding if `first`, the final norm,
    head and loss if `last`; returns the model."""
    keep = {str(i) for i in range(*blocks)}
    for key in [k for k in model.blocks.keys() if k not in keep]:
        del model.blocks[key]
    if not first:
        model.tok_emb = None
    if not last:
        model.norm = model.lm_head = model.loss = None
    return model


def split_stages(model, pp: int, rank: int, virtual_stages: int = 1, stage_layers=None) -> list:
    """[(stage index, pruned copy of `model`)] of the chunks pipeline rank `rank` holds."""
    ranges = partition(model.config.n_layers, pp * virtual_stages, stage_layers)
    last = pp * virtual_stages - 1
    out = []
    for c in range(virtual_stages):
        s = c * pp + rank
        part = _copy_only(model, ranges[s]) if virtual_stages > 1 else model
        out.append((s, prune(part, ranges[s], s == 0, s == last)))
    return out


def _copy_only(model, blocks: tuple):
    """A deep copy of `model` in which the blocks outside [blocks[0], blocks[1]) are None
    (not copied: `prune` drops them), so that a chunk's copy costs its own blocks only."""
    keep = {str(i) for i in range(*blocks)}
    memo = {id(m): None for k, m in model.blocks.items() if k not in keep}
    return copy.deepcopy(model, memo)
