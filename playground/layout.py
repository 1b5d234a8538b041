"""`Layout`: how a training run is split over ranks, validated before any work.

world = pp·dp·cp·tp; mesh axes outermost to innermost pp, dp, cp, tp (TP innermost so its
groups stay inside a node); EP groups are carved out of dp×cp. With hybrid sharding dp is
laid out as dp_replicate × dp_shard (shard innermost: a shard group of neighbouring ranks
stays inside a node; Zhao et al. 2023, FSDP's HYBRID_SHARD). Global batch =
dp × microbatches × micro_batch_size sequences (docs/architecture.md, Contract 5).

Every check says which numbers disagree and what would fit; each strategy's own `rules`
module states what it needs.
"""
from __future__ import annotations

import itertools

import math
from dataclasses import asdict, dataclass

from activation_checkpointing import rules as ac_rules
from moe import rules as expert_rules
from pipeline import rules as pipeline_rules
from sequence_parallel import rules as context_rules
from tensor_parallel import rules as tensor_rules
from zero import rules as zero_rules


class LayoutError(ValueError):
    """A layout that does not fit the world or the model."""


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 4  # (the command line's default is this one)
    stage_layers: tuple | None = None  # blocks per pipeline stage (pp·virtual_stages of them); None: even
    cp_impl: str = "ring"  # context parallelism: "ring" attention or "ulysses" all-to-all
    cp_balance: str = "zigzag"  # which sequence chunks a cp rank holds: "zigzag" or "contiguous"
    ac: str = "none"  # activation checkpointing of every block: "none", "full", "selective" or "selective-op"
    # hybrid sharding: dp = dp_replicate × dp_shard; ZeRO shards over dp_shard (× cp) and the
    # shards are replicated dp_replicate times (1: ZeRO over all of dp, or DDP without --zero)
    dp_replicate: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, over all ranks."""
        return self.dp * self.microbatches * self.micro_batch_size

    @property
    def dp_shard(self) -> int:
        """The data-parallel ranks a ZeRO shard group spans (all of dp without hybrid sharding)."""
        return self.dp // self.dp_replicate

    def mesh_axes(self) -> dict:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}

    def mesh(self, group):
        """The layout's Mesh over `group` (the world): axes pp, dp, cp, tp, with dp split
        under hybrid sharding."""
        from collectives import Mesh
        return Mesh(group, split=self.mesh_split(), **self.mesh_axes())

    def mesh_split(self) -> dict:
        """Mesh(..., split=...): dp as dp_replicate × dp_shard under hybrid sharding."""
        return {"dp": {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}} if self.dp_replicate > 1 else {}

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        axes = " × ".join(f"{k}={v}" for k, v in self.mesh_axes().items() if v > 1) or "1 rank"
        extra = [f"zero={self.zero}"] if self.zero else []
        if self.dp_replicate > 1:
            extra.append(f"hybrid sharding: dp_replicate={self.dp_replicate} × dp_shard={self.dp_shard}")
        if self.sequence_parallel:
            extra.append("sequence parallel")
        if self.ep > 1:
            extra.append(f"ep={self.ep}")
        if self.cp > 1:
            extra.append(f"{self.cp_impl} attention" + (f", {self.cp_balance}" if self.cp_impl == "ring" else ""))
        if self.pp > 1:
            extra.append(f"schedule {self.schedule}" + (f" with {self.virtual_stages} chunks per rank"
                                                        if self.virtual_stages > 1 else ""))
        if self.stage_layers is not None:
            runs = [[n, len(list(g))] for n, g in itertools.groupby(self.stage_layers)]
            extra.append("blocks per stage " + ", ".join(f"{n}×{k}" if k > 1 else f"{n}" for n, k in runs))
        if self.microbatches > 1:
            extra.append(f"{self.microbatches} microbatches")
        if self.ac != "none":
            extra.append(f"{self.ac} activation checkpointing")
        return f"{axes} (world {self.world})" + (", " + ", ".join(extra) if extra else "")

    @classmethod
    def from_counts(cls, world: int | None = None, **kw) -> "Layout":
        """`world` defaults to the product of the axes; axes not given default to 1, except
        that dp takes what is left when only `world` (and other axes) are given."""
        given = {k: v for k, v in kw.items() if v is not None}
        axes = ("dp", "tp", "pp", "cp")
        if world is not None and world < 1:
            raise LayoutError(f"world={world}: must be at least 1")
        for k in axes + ("ep", "microbatches", "virtual_stages", "micro_batch_size", "dp_replicate"):
            if k in given and (not isinstance(given[k], int) or given[k] < 1):
                raise LayoutError(f"--{k.replace('_', '-')} must be a positive integer, got {given[k]!r}")
        if world is not None and "dp" not in given:
            rest = math.prod(given.get(k, 1) for k in axes if k != "dp")
            if world % rest:
                raise LayoutError(f"world={world} is not divisible by tp·pp·cp = {rest}; "
                                  f"dp cannot take the rest (worlds that fit: multiples of {rest})")
            given["dp"] = world // rest
        layout = cls(**given)
        if world is not None and layout.world != world:
            raise LayoutError(f"world={world} but pp·dp·cp·tp = {layout.pp}·{layout.dp}·{layout.cp}·{layout.tp} "
                              f"= {layout.world}")
        return layout

    def validate(self, config) -> "Layout":
        """Raise LayoutError naming the numbers that disagree; return self when it fits. Each
        strategy states what it needs (its `rules` module); the layout asks each in turn."""
        c = config
        for found in (tensor_rules.problem(c, self.tp, self.sequence_parallel, self.cp),
                      pipeline_rules.problem(c, self.pp, self.schedule, self.microbatches, self.virtual_stages,
                                             self.stage_layers),
                      context_rules.problem(c, self.cp, self.cp_impl, self.cp_balance, self.tp),
                      expert_rules.problem(c, self.ep, self.dp, self.cp),
                      ac_rules.problem(self.ac),
                      zero_rules.problem(self.zero, self.dp, self.dp_replicate)):
            if found:
                raise LayoutError(found)
        return self
