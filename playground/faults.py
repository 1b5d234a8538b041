"""Faults on purpose: a crash, a hang, a slow rank or a NaN gradient injected at a step of a
rank (`--inject KIND@STEP:RANK`), and how a run finds each (docs/architecture.md, "Faults").

- `crash@S:R`: rank R raises at the start of step S (`crash!`: the rank is lost for good; a
  restart onto as many ranks cannot continue the run). The others stop at their next call
  (the launcher reports the first failure).
- `hang@S:R`: rank R stops answering at the start of step S, in no call: nothing is
  deadlocked, so the others wait in their next collective until the timeout (`--timeout`,
  NCCL's watchdog), which names every rank waiting, its call, and the ranks that never came.
- `slow:F@S:R`: from step S on, rank R runs F times slower: on simulated time its kernels
  take F times as long (a throttled GPU); on the wall clock it sleeps (F-1) times its own
  forward and backward. The others wait for it (a straggler: their idle time in the step).
- `nan@S:R`: after the backward of step S, one element of rank R's first gradient is NaN
  (a corrupted value on one device). Before every optimizer step each rank checks its loss
  and gradients (one max-norm over them, `torch._foreach_norm`), and a flag per rank,
  all-reduced over the data- and tensor-parallel group and then over the pipeline's stages
  (one all-reduce without a pipeline), tells every rank alike which ranks saw a NaN or an Inf
  (Megatron-LM checks the same before its step); the step is then skipped on every rank, or
  the run stops (`--on-nan skip|stop|off`), naming the first rank and tensor. A plan prices
  the check as a run does it. On a GPU the flags are read a step late (`LaggedCheck`) and
  the optimizer skips the step on the device.

Steps are counted from 1, as the report counts them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from collectives import CollectiveError, ReduceOp

KINDS = ("crash", "hang", "slow", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    step: int  # counted from 1
    rank: int
    factor: float = 1.0  # slow: how many times slower
    permanent: bool = False  # crash!: the rank does not come back

    def __str__(self) -> str:
        kind = f"slow:{self.factor:g}" if self.kind == "slow" else self.kind + ("!" if self.permanent else "")
        return f"{kind}@{self.step}:{self.rank}"


def parse_fault(text: str) -> Fault:
    """KIND@STEP:RANK (KIND: crash, crash!, hang, slow:F, nan) -> Fault; ValueError naming the text."""
    usage = f"--inject {text!r}: give KIND@STEP:RANK, KIND one of crash, crash!, hang, slow:F, nan (e.g. crash@5:1)"
    kind, at, where = text.partition("@")
    step, colon, rank = where.partition(":")
    if not at or not colon:
        raise ValueError(usage)
    try:
        step_n, rank_n = int(step), int(rank)
    except ValueError:
        raise ValueError(usage) from None
    if step_n < 1 or rank_n < 0:
        raise ValueError(f"--inject {text!r}: the step counts from 1 and the rank from 0 (got step {step_n}, "
                         f"rank {rank_n})")
    name, _, factor = kind.partition(":")
    permanent = name == "crash!"
    name = name.rstrip("!") if permanent else name
    if name not in KINDS or (factor and name != "slow"):
        raise ValueError(usage)
    if name == "slow":
        try:
            f = float(factor)
        except ValueError:
            raise ValueError(f"--inject {text!r}: slow needs a factor, slow:F with F > 1 (e.g. slow:3@2:0)") from None
        if not math.isfinite(f) or f <= 1:
            raise ValueError(f"--inject {text!r}: the slow factor must be a number above 1, not {factor}")
        return Fault("slow", step_n, rank_n, factor=f)
    return Fault(name, step_n, rank_n, permanent=permanent)


class InjectedCrash(RuntimeError):
    """What a rank raises at an injected crash."""

    def __init__(self, fault: Fault):
        super().__init__(f"injected crash of rank {fault.rank} at step {fault.step}"
                         + (" (for good)" if fault.permanent else ""))
        self.fault = fault

    def __reduce__(self):  # (a gloo rank's exception travels to the launcher pickled)
        return InjectedCrash, (self.fault,)


class NonFiniteError(CollectiveError):
    """A NaN or an Inf in the loss or a gradient, found on every rank alike before the
    optimizer step (with --on-nan stop)."""


class RankFaults:
    """This rank's faults, applied where its program reaches them."""

    def __init__(self, faults, rank: int):
        self.faults = [f for f in faults if f.rank == rank]

    def before_step(self, world, step: int) -> None:
        """At the start of `step` (from 1): an injected crash raises, a hang stops answering."""
        for f in self.faults:
            if f.step == step and f.kind == "crash":
                raise InjectedCrash(f)
            if f.step == step and f.kind == "hang":
                world.stall()

    def slowdown(self, step: int) -> float:
        """How many times slower this rank runs at `step`."""
        return max((f.factor for f in self.faults if f.kind == "slow" and f.step <= step), default=1.0)

    def straggle(self, step: int, seconds: float) -> None:
        """On the wall clock: sleep what a slow rank takes more for `seconds` of its work."""
        factor = self.slowdown(step)
        if factor > 1:
            time.sleep((factor - 1) * seconds)

    def corrupt(self, model, step: int) -> None:
        """After the backward of `step`: a NaN in this rank's first gradient."""
        if any(f.kind == "nan" and f.step == step for f in self.faults):
            grads = model.local_grads()
            if grads:
                with torch.no_grad():
                    grads[0][1].view(-1)[0] = float("nan")


def nonfinite_flags(model, total, world, groups, check_grads: bool = True) -> tuple:
    """(flags, names): whether any rank's loss or gradients hold a NaN or an Inf, on the device,
    the same on every rank: flags[r] is 1 + the index in rank r's `names` (its loss, then its
    gradients in the model's order) of its first tensor that does, 0 if none does; one max-norm
    over the gradients (`torch._foreach_norm`), all-reduced over each of `groups`, which
    together span `world`."""
    grads = model.local_grads() if check_grads else []
    values = [total.detach().reshape(1).to(torch.float32)]
    if grads:
        values.append(torch.stack(torch._foreach_norm([g for _, g in grads], math.inf)).to(torch.float32))
    bad = ~torch.cat(values).isfinite()
    index = torch.arange(1, bad.numel() + 1, dtype=torch.float32, device=bad.device)
    flags = torch.zeros(world.size, dtype=torch.float32, device=total.device)
    flags[world.rank] = torch.where(bad, index, bad.numel() + 1).amin() % (bad.numel() + 1)
    for group in groups:
        group.all_reduce(flags, op=ReduceOp.MAX, label="faults.nonfinite")
    return flags, ["the loss"] + [f"the gradient of {name}" for name, _ in grads]


def describe_nonfinite(flags: list, names: list, world) -> str | None:
    """What `nonfinite_flags` found, read on the host (`flags` as numbers): None if nothing, else
    the lowest rank that saw a NaN or an Inf and its first such tensor (each rank names its
    own: one all-gather of the names, by every rank alike)."""
    bad = [r for r, v in enumerate(flags) if v]
    if not bad:
        return None
    mine = names[int(flags[world.rank]) - 1] if world.rank in bad else None
    where = world.all_gather_object(mine)
    first = bad[0]
    return (f"a NaN or an Inf in {where[first]} on rank {first}"
            + (f" (ranks {bad} had some)" if len(bad) > 1 else ""))


def nonfinite(model, total, world, groups, check_grads: bool = True) -> str | None:
    """`nonfinite_flags` read on the host at once (None on the meta device, which has no values)."""
    flags, names = nonfinite_flags(model, total, world, groups, check_grads)
    return None if flags.is_meta else describe_nonfinite(flags.tolist(), names, world)


class LaggedCheck:
    """The check read one step late, so that the host never waits for the device to finish a
    step's backward before it issues the optimizer step (a GPU's queue would drain and refill
    once a step: benchmarks/results/gpu/run50_moe_device_only). The step's optimizer is given
    `found` (1.0 where any rank saw a NaN or an Inf) and skips its update on the device, as
    torch's fused AdamW does under a GradScaler; the flags go to the host asynchronously and
    are read during the next step, before its optimizer step: so `--on-nan stop` stops with
    the weights of the step before the poisoned one, as the immediate check does, and `skip`
    reports the step one step later."""

    def __init__(self):
        self.pending = None  # the last step's (step, flags on the host, the event after their copy, names)
        self.earlier = None  # the step's before it

    def check(self, step: int, model, total, world, groups, check_grads: bool = True) -> torch.Tensor:
        """This step's flags, started towards the host; `found` on the device."""
        flags, names = nonfinite_flags(model, total, world, groups, check_grads)
        found = (flags.amax() > 0).to(torch.float32)
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = flags.clone(), None
        self.earlier, self.pending = self.pending, (step, host, ready, names)
        return found

    def read(self, world, earlier: bool = True) -> tuple:
        """(step, what was found or None) of the step before the last `check` (`earlier`), or of
        the last; (None, None) where there is none."""
        entry = self.earlier if earlier else self.pending
        if entry is None:
            return None, None
        step, host, ready, names = entry
        if ready is not None:
            ready.synchronize()  # (long done: recorded a step ago)
        return step, describe_nonfinite(host.tolist(), names, world)
