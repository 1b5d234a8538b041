"""`Layout`: how a training run is split over ranks, validated before any work.

world = pp·dp·cp·tp; mesh axes outermost to innermost pp, dp, cp, tp (TP innermost so its
groups stay inside a node); EP groups are carved out of dp×cp. With hybrid sharding dp is
laid out as dp_replicate × dp_shard (shard innermost: a shard group of neighbouring ranks
stays inside a node; Zhao et al. 2023, FSDP's HYBRID_SHARD). Global batch =
dp × microbatches × micro_batch_size sequences (docs/architecture.md, Contract 5).

Every check says which numbers disagree and what would fit.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from activation_checkpointing import MODES as AC_MODES
from pipeline import SCHEDULES, ScheduleError, build_schedule
from sequence_parallel.balance import BALANCES, IMPLEMENTATIONS, n_chunks


class LayoutError(ValueError):
    """A layout that does not fit the world or the model."""


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    ac: str = "none"  # activation checkpointing of every block: "none", "full" or "selective"
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
        """Raise LayoutError naming the numbers that disagree; return self when it fits."""
        c = config
        if self.tp > 1 and c.n_heads % self.tp:
            raise LayoutError(f"n_heads={c.n_heads} is not divisible by tp={self.tp}; "
                              f"tp could be one of {divisors(c.n_heads)}")
        if self.tp > 1 and c.kv_heads % self.tp:
            raise LayoutError(f"n_kv_heads={c.kv_heads} is not divisible by tp={self.tp} (tensor parallelism splits "
                              f"the key/value heads too); tp could be one of {divisors(c.kv_heads)}")
        stages = self.pp * self.virtual_stages
        if self.stage_layers is not None:
            if len(self.stage_layers) != stages or sum(self.stage_layers) != c.n_layers or min(self.stage_layers) < 1:
                raise LayoutError(f"stage_layers={list(self.stage_layers)}: give {stages} positive block counts "
                                  f"(pp·virtual_stages) summing to n_layers={c.n_layers}")
        elif c.n_layers % stages:
            raise LayoutError(f"n_layers={c.n_layers} is not divisible by pp·virtual_stages = {self.pp}·"
                              f"{self.virtual_stages} = {stages}; stage counts that fit: {divisors(c.n_layers)}")
        if self.cp_impl not in IMPLEMENTATIONS:
            raise LayoutError(f"cp_impl={self.cp_impl!r}: choose one of {IMPLEMENTATIONS}")
        if self.cp_balance not in BALANCES:
            raise LayoutError(f"cp_balance={self.cp_balance!r}: choose one of {BALANCES}")
        if self.cp > 1 and c.attention != "flash":
            raise LayoutError(f"cp={self.cp} needs attention='flash' (ring attention and Ulysses run the flash kernel; "
                              f"attention={c.attention!r} would be silently replaced)")
        if self.cp > 1:
            n = n_chunks(self.cp, self.cp_balance)
            if c.seq_len % n:
                what = "2·cp" if self.cp_balance == "zigzag" else "cp"
                fits = [d for d in divisors(c.seq_len) if c.seq_len % n_chunks(d, self.cp_balance) == 0]
                raise LayoutError(f"seq_len={c.seq_len} is not divisible by {what} = {n} ({self.cp_balance} cuts the "
                                  f"sequence into {n} chunks); cp could be one of {fits}, or seq_len a multiple of {n}")
            if self.cp_impl == "ulysses" and c.kv_heads % (self.cp * self.tp):
                heads = "n_heads" if c.kv_heads == c.n_heads else "n_kv_heads"
                raise LayoutError(f"Ulysses splits the heads over cp: {heads}={c.kv_heads} is not divisible by "
                                  f"cp·tp = {self.cp}·{self.tp} = {self.cp * self.tp}; cp could be one of "
                                  f"{divisors(c.kv_heads // self.tp)}")
            if self.sequence_parallel and (c.seq_len // self.cp) % self.tp:
                raise LayoutError(f"sequence parallelism splits each cp rank's seq_len/cp = {c.seq_len // self.cp} "
                                  f"tokens over tp={self.tp}: not divisible")
        if self.ep > 1 and not c.n_experts:
            raise LayoutError(f"ep={self.ep} shards experts, and the model has none (n_experts=0): choose an MoE "
                              f"preset (tiny-moe, small-moe, 1b-moe) or give --experts")
        if self.ep > 1 and (self.dp * self.cp) % self.ep:
            raise LayoutError(f"ep={self.ep} must divide dp·cp = {self.dp}·{self.cp} = {self.dp * self.cp} (expert-"
                              f"parallel groups are carved from the data-parallel ranks); ep could be one of "
                              f"{divisors(self.dp * self.cp)}")
        if self.ep > 1 and c.n_experts % self.ep:
            raise LayoutError(f"n_experts={c.n_experts} is not divisible by ep={self.ep}; ep could be one of "
                              f"{[d for d in divisors(c.n_experts) if (self.dp * self.cp) % d == 0]}")
        if c.n_experts and self.tp > 1 and not self.sequence_parallel:
            raise LayoutError(f"tp={self.tp} with experts needs --sp: each TP rank then routes its slice of the "
                              f"sequence, so no token reaches the experts twice")
        if self.ac not in AC_MODES:
            raise LayoutError(f"ac={self.ac!r}: choose one of {AC_MODES}")
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"zero={self.zero}: choose 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise LayoutError(f"schedule={self.schedule!r}: choose one of {SCHEDULES}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise LayoutError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved', "
                              f"got {self.schedule!r}")
        if self.pp > 1:
            try:  # the schedule says which microbatch counts it allows
                build_schedule(self.schedule, self.pp, self.microbatches, self.virtual_stages)
            except ScheduleError as e:
                raise LayoutError(f"pp={self.pp}, schedule {self.schedule!r}: {e}") from None
        if self.dp % self.dp_replicate:
            raise LayoutError(f"dp_replicate={self.dp_replicate} does not divide dp={self.dp}; it could be one of "
                              f"{divisors(self.dp)}")
        if self.dp_replicate > 1 and not self.zero:
            raise LayoutError(f"dp_replicate={self.dp_replicate}: hybrid sharding replicates ZeRO's shards; without "
                              f"--zero every parameter is replicated already (DDP): add --zero 1, 2 or 3")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel needs tp > 1")
        if self.tp > 1 and c.d_ff % self.tp:
            raise LayoutError(f"d_ff={c.d_ff} is not divisible by tp={self.tp}; "
                              f"tp could be one of {[d for d in divisors(c.d_ff) if c.n_heads % d == 0]}")
        if self.sequence_parallel and c.seq_len % self.tp:
            raise LayoutError(f"sequence parallelism splits seq_len={c.seq_len} over tp={self.tp}: not divisible")
        return self
