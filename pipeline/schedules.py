"""Pipeline schedules as data: for each rank, the ordered list of actions it runs in one
step. One executor (`executor.py`) runs any of them.

Compute actions: `F` forward of microbatch i on chunk c (the rank's c-th model chunk:
virtual stage c·p + r), `B` its whole backward, or, split as in zero-bubble pipelines,
`I` (the gradient of the chunk's input) and `W` (the gradients of its weights).
`with_communication` adds the point-to-point actions around them: `RECV_F` before a
forward whose input comes from another stage, `SEND_F` after it, `RECV_B` before a
backward whose output gradient comes from the next stage, `SEND_B` after it (after `I`
when the backward is split).

- GPipe (Huang et al. 2019): every forward, then every backward.
- 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training"): min(p − r − 1, m) warm-up forwards on rank r, then one forward and one
  backward in turn, then the remaining backwards; at most p − r microbatches in flight.
- Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM"): v chunks per rank, microbatches in groups of p
  (so m must be a multiple of p), Megatron's warm-up of 2(p − r − 1) + (v − 1)p.
- ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B's order of forwards
  and backwards with the backward split into I and W, each W deferred to a slot where the
  next F or I would wait (found by running the order with unit costs F = I = W), the rest
  at the end. Dependencies are what the executor enforces, so the order is valid under
  any costs.
"""
from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1")


class ScheduleError(ValueError):
    """A schedule that cannot run the given pipeline."""


@dataclass(frozen=True)
class Action:
    kind: str  # F, B, I, W, RECV_F, SEND_F, RECV_B, SEND_B
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def gpipe(p: int, m: int, v: int = 1) -> list:
    _plain(v, "gpipe")
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int, v: int = 1) -> list:
    _plain(v, "1f1b")
    out = []
    for r in range(p):
        warm = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(warm)]
        for j in range(m - warm):
            acts += [Action("F", warm + j), Action("B", j)]
        acts += [Action("B", j) for j in range(m - warm, m)]
        out.append(acts)
    return out


def interleaved(p: int, m: int, v: int = 2) -> list:
    if v < 2:
        raise ScheduleError(f"interleaved 1F1B needs virtual stages v >= 2 per rank, got {v}")
    if m % p:
        raise ScheduleError(f"interleaved 1F1B runs microbatches in groups of pp={p}: microbatches={m} is not a "
                            f"multiple of {p} (try {max(p, m - m % p)} or {m - m % p + p})")
    total = m * v

    def mb(k):
        return (k // (p * v)) * p + k % p

    def chunk(k, forward):
        c = (k // p) % v
        return c if forward else v - 1 - c
    out = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [Action("F", mb(k), chunk(k, True)) for k in range(warm)]
        for j in range(total - warm):
            acts += [Action("F", mb(warm + j), chunk(warm + j, True)), Action("B", mb(j), chunk(j, False))]
        acts += [Action("B", mb(j), chunk(j, False)) for j in range(total - warm, total)]
        out.append(acts)
    return out


def zb_h1(p: int, m: int, v: int = 1) -> list:
    _plain(v, "zb1")
    # 1F1B's order of forwards and input-gradient passes, with B replaced by I
    order = [[Action("I" if a.kind == "B" else a.kind, a.microbatch) for a in row] for row in one_f_one_b(p, m)]
    done: dict = {}  # (kind, rank, microbatch) -> finish time, unit costs
    acts = [[] for _ in range(p)]
    pos, pending_w, free_at = [0] * p, [[] for _ in range(p)], [0] * p
    t = 0
    while any(len(a) < 3 * m for a in acts):
        for r in range(p):
            if free_at[r] > t:
                continue
            a = order[r][pos[r]] if pos[r] < len(order[r]) else None
            if a is not None and a.kind == "F":
                dep = ("F", r - 1, a.microbatch) if r > 0 else None
            elif a is not None:
                dep = ("I", r + 1, a.microbatch) if r < p - 1 else ("F", r, a.microbatch)
            alive = sum(1 for x in acts[r] if x.kind == "F") - sum(1 for x in acts[r] if x.kind == "W")
            if a is not None and a.kind == "F" and alive >= p and pending_w[r]:
                a = None  # the peak memory of 1F1B: at most p microbatches alive (their W pending)
            if a is not None and (dep is None or done.get(dep, t + 1) <= t):
                pos[r] += 1
                if a.kind == "I":
                    pending_w[r].append(a.microbatch)
            elif pending_w[r]:  # the next F or I must wait: a deferred W fills the slot
                a = Action("W", pending_w[r].pop(0))
            else:
                continue
            acts[r].append(a)
            done[(a.kind, r, a.microbatch)] = free_at[r] = t + 1
        t += 1
    return acts


def _plain(v: int, name: str) -> None:
    if v != 1:
        raise ScheduleError(f"schedule {name!r} runs one chunk per rank; virtual stages (v={v}) need 'interleaved'")


def fewest_microbatches(name: str, p: int) -> int:
    """The fewest microbatches a step of schedule `name` on `p` ranks can run (the
    interleaved schedule runs them in groups of p)."""
    return p if name == "interleaved" else 1


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list:
    """Compute actions per rank for schedule `name`, with the communication added."""
    makers = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb1": zb_h1}
    if name not in makers:
        raise ScheduleError(f"schedule {name!r}: choose one of {SCHEDULES}")
    if m < 1:
        raise ScheduleError(f"microbatches must be >= 1, got {m}")
    return with_communication(makers[name](p, m, v), p, v)


def with_communication(schedule: list, p: int, v: int) -> list:
    """Add RECV/SEND actions around each compute action whose neighbour stage is on another
    rank (virtual stage s = c·p + r; its neighbours s − 1 and s + 1)."""
    last = p * v - 1
    out = []
    for r, acts in enumerate(schedule):
        full = []
        for a in acts:
            s = a.chunk * p + r
            if a.kind == "F":
                full += ([Action("RECV_F", a.microbatch, a.chunk)] if s > 0 else []) + [a]
                full += [Action("SEND_F", a.microbatch, a.chunk)] if s < last else []
            elif a.kind in ("B", "I"):
                full += ([Action("RECV_B", a.microbatch, a.chunk)] if s < last else []) + [a]
                full += [Action("SEND_B", a.microbatch, a.chunk)] if s > 0 else []
            else:
                full.append(a)
        out.append(full)
    return out


def table(schedule: list, compute_only: bool = True) -> str:
    """The schedule as text: one row per rank, one column per action."""
    rows = [[str(a) for a in acts if not compute_only or a.kind in ("F", "B", "I", "W")] for acts in schedule]
    width = max((len(x) for row in rows for x in row), default=1)
    return "\n".join(f"rank {r}: " + " ".join(x.ljust(width) for x in row) for r, row in enumerate(rows))


def timeline(schedule: list, p: int, v: int = 1, costs=None) -> list:
    """Per rank, [(action, start, end)] of the compute actions when each takes its cost
    (per action kind for a whole stage, a chunk costing 1/v; default F = I = W = 1 and
    B = I + W) and communication is free: the theory the simulated clock is checked
    against, and the classic picture."""
    costs = {"F": 1.0, "I": 1.0, "W": 1.0, **(costs or {})}
    costs.setdefault("B", costs["I"] + costs["W"])
    last = p * v - 1
    acts = [[a for a in row if a.kind in ("F", "B", "I", "W")] for row in schedule]
    done, pos, now = {}, [0] * p, [0.0] * p
    spans = [[] for _ in range(p)]
    while any(pos[r] < len(acts[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                s = a.chunk * p + r
                if a.kind == "F":
                    dep = ("F", s - 1, a.microbatch) if s > 0 else None
                elif a.kind in ("B", "I"):
                    dep = ("BI", s + 1, a.microbatch) if s < last else ("F", s, a.microbatch)
                else:
                    dep = ("BI", s, a.microbatch)
                if dep is not None and dep not in done:
                    break
                start = max(now[r], done.get(dep, 0.0))
                now[r] = start + costs[a.kind] / v
                spans[r].append((a, start, now[r]))
                done[("BI" if a.kind in ("B", "I") else a.kind, s, a.microbatch)] = now[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleError("the schedule deadlocks: every rank waits on another")
    return spans


def makespan(schedule: list, p: int, v: int = 1, costs=None) -> float:
    """The step time of `timeline`."""
    return max(end for row in timeline(schedule, p, v, costs) for _, _, end in row)
