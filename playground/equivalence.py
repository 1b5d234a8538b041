"""The equivalence check (docs/architecture.md, Contract 5).

The layout trains k AdamW steps in its own dtype, recording the state each step starts
from (weights and moments) and each step's gradients, gathered to full tensors from the
pieces every rank holds (Contract 4; replicas must agree bitwise). Its initial weights
must be exactly the reference's (each a slice of the tensor generated from (seed, name)).
Then the reference model runs on one rank in float64, every step from the layout's own
state before that step, on the same global batch, and the two are compared: the loss and
every gradient of each step, and every weight and both AdamW moments after it. Taking each
step from the same state keeps the comparison at one step's rounding: two runs that start
equal drift apart by rounding amplified through AdamW (an element with a tiny gradient is
divided by √v + eps), and that drift says nothing about the layout.

Each quantity is judged against a tolerance derived from the arithmetic
(playground/tolerance.py): loss and gradients within a fixed number of units of roundoff
of the tensor's largest reference value; each element of the weights and moments within
what AdamW can make of gradients that pass. A row's `ratio` is its worst error over its
tolerance, over the steps (at most 1 passes; the margin is its inverse). Errors are also
shown relative: loss and gradients over max |reference|, weights over the largest change
the reference's step made to the tensor, moments over max |reference|.

Mixture of experts: the layout's ranks record each token group's routing decision; the
reference replays a decision where its own differs only by a near-tie (model.moe.Replay),
so that a verdict does not depend on how a machine rounds the last bit of a router logit;
a difference beyond a tie is a problem, and fails. The balancing biases (optimizer-free
state, "buffer" pieces) are gathered like the weights (replicas must agree bitwise), the
reference starts each step from the layout's and moves them by its own load, and each is
compared after the step ("bias" rows: within a few units of roundoff of its size).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from model import GPT, assemble
from model.moe import MoEStats, Replay, TokenGroups
from sequence_parallel.balance import positions
from zero.optimizer import step_count

from .data import make_source
from .run_config import RunConfig
from .sensitivity import TRIGGER, moved, raised
from .tolerance import UNIT_ROUNDOFF, step_bounds, tolerances
from .training import train

KINDS = ("param", "exp_avg", "exp_avg_sq")
BUFFER = "buffer"  # the MoE layers' balancing biases (ParallelModel.buffers)


@dataclass
class Row:
    what: str  # "loss", "grad", "weight", "moments", "bias", "dropped"
    name: str
    max_abs: float
    max_rel: float
    ratio: float | None  # the worst error over its tolerance (at most 1 passes); None: not judged
    step: int | None = None  # gradients, weights, moments: the step of the worst error
    raised: float | None = None  # a gradient judged at the reference's own sensitivity there: its tolerance

    @property
    def label(self) -> str:
        """The tensor, with its worst step."""
        return self.name if self.step is None else f"{self.name} (step {self.step})"

    @property
    def ok(self) -> bool:
        return self.ratio is None or self.ratio <= 1.0


@dataclass
class CheckReport:
    run: RunConfig
    tolerance: dict  # loss, grad, routing: relative tolerance (None: not judged); weight: True if judged
    rows: list
    problems: list  # coverage, replica, initial-weight and routing problems
    result: object = None  # the layout's TrainResult (losses, ledger, memory, ...)
    ties: int = 0  # MoE token groups whose routing the reference took from the layout at a near-tie
    tied: int = 0  # the assignments those decisions differed in
    # {(step, name): gradient tolerance} raised to the reference's own sensitivity (playground/sensitivity.py)
    sensitive: dict = None

    @property
    def passed(self) -> bool:
        return not self.problems and all(r.ok for r in self.rows)

    def worst(self, what: str) -> Row | None:
        """The row of `what` nearest to (or furthest over) its tolerance; by relative error
        where it is not judged."""
        return max((r for r in self.rows if r.what == what),
                   key=lambda r: (r.ratio is not None, r.ratio if r.ratio is not None else r.max_rel), default=None)

    @property
    def ratio(self) -> float:
        """The largest error over its tolerance of all judged rows (inf with a problem)."""
        if self.problems:
            return float("inf")
        return max((r.ratio for r in self.rows if r.ratio is not None), default=0.0)


def token_groups(run: RunConfig) -> TokenGroups:
    """The token groups the layout's ranks route (model/moe.py): a row group per dp rank and
    microbatch (its statistics group is the microbatch), a sequence group per cp rank."""
    layout, seq = run.layout, run.model.seq_len
    rows, stats = [], []
    per_rank = layout.microbatches * layout.micro_batch_size
    for d in range(layout.dp):
        for m in range(layout.microbatches):
            first = d * per_rank + m * layout.micro_batch_size
            rows.append(list(range(first, first + layout.micro_batch_size)))
            stats.append(m)
    seqs = [positions(seq, layout.cp, c, layout.cp_balance) for c in range(layout.cp)] if layout.cp > 1 \
        else [list(range(seq))]
    if layout.sequence_parallel:  # each TP rank holds a contiguous slice of its cp rank's tokens
        n = len(seqs[0]) // layout.tp
        seqs = [s[t * n:(t + 1) * n] for s in seqs for t in range(layout.tp)]
    return TokenGroups(rows, stats, seqs)


def reference_model(run: RunConfig, dtype=torch.float64) -> GPT:
    """The one-device reference in float64 (or `dtype`), initialised as every layout is (or
    from --init-from)."""
    init = torch.load(run.init_from, map_location="cpu", weights_only=True) if run.init_from else None
    return GPT(run.model, dtype=dtype, device="meta").materialize("cpu", run.seed, init)


def _low_precision_step(run: RunConfig, model: GPT, params: dict, batch, autocast, loss_scale: float = 1.0):
    """One step's loss and gradients (float64) on one device in the run's own recipe (16-bit,
    or float32): a forward and backward per micro-batch of the layout's size, the losses scaled by their
    count (and in float16 multiplied by the layout's loss scale of the step, Micikevicius et
    al. 2018, divided out of the gradients after), the gradients accumulated in the layout's
    dtype for them (the compute dtype, or float32 with `grad_dtype`), as the layout's ranks
    accumulate and sum theirs. A mixture of experts runs the batch in one pass: its reference
    routes the layout's token groups over the whole batch (`MoE._reference`), their
    balancing statistics spanning micro-batches."""
    size = run.layout.micro_batch_size if not model.moe_layers() else batch.shape[0]
    count = batch.shape[0] // size
    wide = run.grad_dtype == "float32" and not run.autocast
    for layer in model.moe_layers():  # (the auxiliary losses' gradients scaled as the loss's)
        layer.loss_scale = loss_scale
    acc, loss = {}, 0.0
    for i in range(count):
        piece = batch[i * size:(i + 1) * size]
        with autocast:
            part = model(piece[:, :-1], piece[:, 1:]) / count
        (part * loss_scale if loss_scale != 1.0 else part).backward()
        loss += part.item()
        if wide:  # float32 main gradients beside 16-bit weights (Megatron-LM's)
            for n, p in params.items():
                acc[n] = acc[n] + p.grad.float() if n in acc else p.grad.float()
                p.grad = None
    grads = acc if wide else {n: p.grad.detach() for n, p in params.items()}
    grads = {n: g.to(torch.float64, copy=True) / loss_scale for n, g in grads.items()}
    for n, p in params.items():  # (unscaled, for the optimizer's step after it)
        p.grad = grads[n].to(p.dtype)
    return torch.tensor(loss), grads


def reference_steps(run: RunConfig, tol: dict, states: list, replays: list | None = None,
                    low_precision: bool = False) -> list:
    """Each step of the reference taken from the layout's state before it: `states[t]` is
    {kind: {name: full tensor}} (no moments before the first step), `replays[t]` the
    layout's routing decisions of step t per MoE block. Returns per step the loss, the
    gradients (float64), the state after the step, its bounds (tolerance.step_bounds; None
    when weights are not judged) and the MoE layers' statistics. `low_precision`: one device
    in the run's own dtype and recipe instead of float64 (bf16 or fp16 weights rounded from
    the state, float32 ones under autocast, or float32 ones in a float32 run; the layout's
    micro-batches and loss scales, _low_precision_step), whose gradients say how far the
    dtype's rounding alone moves them."""
    cfg, layout = run.model, run.layout
    low = torch.float32 if run.autocast else getattr(torch, run.dtype)  # (the compute dtype)
    model = reference_model(run, low if low_precision else torch.float64)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if low_precision and run.autocast
                else contextlib.nullcontext())
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=run.lr, betas=run.betas, weight_decay=run.weight_decay)
    group = opt.param_groups[0]
    unit = UNIT_ROUNDOFF[str(run.param_dtype).removeprefix("torch.")]
    source = make_source(run.data, cfg.vocab_size, run.seed)
    groups = token_groups(run)
    for layer in model.moe_layers():
        layer.groups = groups
    taken = 0  # optimizer steps taken (the fp16 loss scaler may skip one)
    out = []
    biases = {f"blocks.{layer.index}.mlp.expert_bias": layer for layer in model.moe_layers()
              if layer.expert_bias is not None}
    for step in range(run.steps):
        state = states[step]
        with torch.no_grad():
            for name, layer in biases.items():  # (a bias no rank holds is a problem of layout_states)
                if name in state[BUFFER]:
                    layer.expert_bias.copy_(state[BUFFER][name])
            for name, p in params.items():
                p.copy_(state["param"][name])
                opt.state[p] = {"step": step_count(opt, p, taken), "exp_avg": state["exp_avg"][name].to(p.dtype, copy=True),
                                "exp_avg_sq": state["exp_avg_sq"][name].to(p.dtype, copy=True)} if taken else {}
        for layer in model.moe_layers():
            layer.stats = MoEStats()
            layer.replay = Replay(replays[step].get(layer.index, {}), tol["routing"]) if replays else None
        batch = source.global_batch(step, layout.global_batch, cfg.seq_len)
        if low_precision:
            scale = states[step + 1].get("loss_scale") if step + 1 < len(states) else None
            loss, grads = _low_precision_step(run, model, params, batch, autocast, scale or 1.0)
        else:
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            grads = {n: p.grad.detach().to(torch.float64, copy=True) for n, p in params.items()}
        skipped = states[step + 1]["skipped"] if step + 1 < len(states) else False
        if not skipped:
            opt.step()
            taken += 1
        opt.zero_grad(set_to_none=True)
        for layer in biases.values():
            layer.update_bias()
        after = {BUFFER: {n: layer.expert_bias.clone() for n, layer in biases.items()},
                 "param": {n: p.detach().clone() for n, p in params.items()},
                 **{k: {n: opt.state[p][k].clone() for n, p in params.items()} for k in KINDS[1:] if taken}}
        bounds = None
        if tol["weight"] and not skipped:
            bounds = {n: step_bounds(grads[n], {k: after[k][n] for k in KINDS}, taken, group, tol["grad"], unit)
                      for n in params}
        stats = [layer.stats.resolved() for layer in model.moe_layers()]
        moe = sum(st.aux + st.z for st in stats)  # part of the loss
        out.append({"loss": loss.item() + moe, "grads": grads, "after": after, "bounds": bounds,
                    "moe": stats, "skipped": skipped, "taken": taken, "group": group})
    return out


def checkable(run: RunConfig) -> None:
    """Raise ValueError naming the value when `run` cannot be checked against one device."""
    run.layout.validate(run.model)
    if run.model.attention_dropout:
        raise ValueError(f"check needs attention_dropout=0, not {run.model.attention_dropout}: each rank draws its own "
                         f"dropout masks, so no layout computes one device's numbers")


def replays(res, run: RunConfig) -> tuple:
    """([per step: {block: {(row group, sequence group): (probs, Decision)}}], problems): the
    routing decisions the layout's ranks recorded, keyed by the reference's token groups
    (`token_groups`); a rank that recorded another number of calls than microbatches is a
    problem."""
    layout = run.layout
    m, slices = layout.microbatches, layout.tp if layout.sequence_parallel else 1
    out, problems = [{} for _ in range(run.steps)], []
    for rank, v in enumerate(res.values):
        d, c, t = v["token_group"]
        for step, layers in enumerate(v.get("moe") or []):
            for index, st in layers.items():
                calls = st["decisions"]
                if len(calls) != m:
                    problems.append(f"routing: rank {rank} recorded {len(calls)} calls of block {index} in step "
                                    f"{step}, not one per microbatch ({m})")
                for mb, decision in enumerate(calls):
                    out[step].setdefault(index, {})[(d * m + mb, c * slices + t)] = decision
    return out, problems


def layout_states(res, run: RunConfig) -> tuple:
    """([the layout's state before each step: {kind: {name: full}, "skipped": bool,
    "loss_scale": the fp16 loss scale of the step before it, or None}], [its gradients of
    each step], problems), gathered from every rank's pieces."""
    problems, states, grads = [], [], []

    def state(pieces_of, label, skipped=False):
        out = {"skipped": skipped}
        for kind in KINDS + (BUFFER,):
            full, probs = assemble(pieces_of(kind))
            problems.extend(f"{label}: {kind}: {p}" for p in probs)
            out[kind] = full
        return out
    states.append(state(lambda kind: [[(pl, t) for k, pl, t in v["initial"] if k == kind] for v in res.values],
                        "before step 0"))
    names = [f"blocks.{i}.mlp.expert_bias" for i in range(run.model.n_layers)
             if run.model.is_moe(i) and run.model.bias_update_rate]
    missing = [n for n in names if n not in states[0][BUFFER]]
    if missing:
        problems.append(f"{missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                        + " held by no rank")
    for step in range(run.steps):
        full, probs = assemble(res.pieces("grads", step))
        skipped = any(v["steps"][step]["skipped"] for v in res.values)
        if not skipped:  # (a skipped step's gradients, an overflow or a NaN, are not compared)
            problems.extend(f"gradients of step {step}: {p}" for p in probs)
        grads.append(full)
        states.append(state(lambda kind: res.pieces(kind, step), f"after step {step}", skipped))
        states[-1]["loss_scale"] = res.values[0]["steps"][step].get("loss_scale")
    return states, grads, problems


def _initial_problems(run: RunConfig, initial: dict) -> list:
    """The layout's initial weights against the reference's, rounded to the layout's dtype:
    bitwise (Contract 4: every shard a slice of the one full tensor)."""
    dtype, out = run.param_dtype, []
    for name, want in reference_model(run).named_parameters():
        got = initial.get(name)
        if got is None:
            out.append(f"initial weights: {name} is held by no rank")
        elif not torch.equal(got, want.detach().to(dtype).double()):
            n = int((got != want.detach().to(dtype).double()).sum())
            out.append(f"initial weights: {name} differs from the reference's in {n} of {got.numel()} elements "
                       f"(a shard initialised from the wrong slice?)")
    return out


def _absent(states: list, names: list) -> list:
    """Problems: a weight, or after a step taken a moment, that no rank holds."""
    out = []
    for i, state in enumerate(states):
        kinds = [k for k in KINDS if k == "param" or state[k] or i and states[i - 1][k]]
        for kind in kinds:
            missing = [n for n in names if n not in state[kind]]
            if missing:
                when = "before step 0" if i == 0 else f"after step {i - 1}"
                out.append(f"{when}: {kind} of {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1
                                                                else "") + " held by no rank")
    return out


class _Worst:
    """The worst (ratio, step, abs, rel) of one tensor over the steps."""

    def __init__(self):
        self.ratio, self.step, self.abs, self.rel, self.raised = None, None, 0.0, 0.0, None

    def add(self, step, diff, rel, ratio, raised=None) -> None:
        self.abs, self.rel = max(self.abs, diff), max(self.rel, rel)
        if ratio is not None and (self.ratio is None or ratio > self.ratio):
            self.ratio, self.step, self.raised = ratio, step, raised


def _over(diff, bound):
    """max over elements of diff / bound (0 / 0: no error; x / 0: inf)."""
    if not diff.numel():
        return 0.0
    return torch.where(diff > 0, diff / bound, torch.zeros_like(diff)).max().item()


def _tensors(ref: list, states: list, grads: list, tol: dict, sensitive: dict) -> dict:
    """{(what, name): _Worst} of every gradient, weight and moment over the steps; a gradient
    at a (step, name) of `sensitive` judged against its raised tolerance there."""
    worst = {}
    for step, r in enumerate(ref):
        for name, want in r["grads"].items():
            got = grads[step].get(name)
            if got is None or r["skipped"]:  # (an overflowed fp16 step's gradients are not compared)
                continue
            diff = (got - want).abs().max().item() if got.numel() else 0.0
            scale = want.abs().max().item() if want.numel() else 0.0
            rel = diff / scale if scale > 0 else diff
            limit = sensitive.get((step, name), tol["grad"])
            ratio = None if limit is None else \
                0.0 if diff == 0 else rel / limit if scale > 0 else float("inf")  # (a zero reference: exact only)
            worst.setdefault(("grad", name), _Worst()).add(step, diff, rel, ratio, sensitive.get((step, name)))
        before, after = states[step]["param"], states[step + 1]
        for name in r["grads"]:
            for kind in (k for k in KINDS if k in r["after"]):
                got, want = after[kind].get(name), r["after"][kind][name]
                if got is None:
                    continue
                d = (got - want).abs()
                diff = d.max().item() if d.numel() else 0.0
                scale = ((want - before[name]).abs() if kind == "param" else want.abs()).max().item() \
                    if want.numel() else 0.0
                rel = diff / scale if scale > 0 else diff
                ratio = _over(d, r["bounds"][name][kind]) if r["bounds"] is not None else None
                what = "weight" if kind == "param" else "moments"
                worst.setdefault((what, name), _Worst()).add(step, diff, rel, ratio)
    return worst


def check(run: RunConfig) -> CheckReport:
    run = replace(run, progress=False)
    checkable(run)
    tol = tolerances(run.dtype)
    # router probabilities this close are a tie broken by rounding (in bf16 the decisions its
    # router logits flip are near-ties at bf16's share, replayed as in float64: the gradients
    # of every token routed alike are then judged as a dense model's)
    tol["routing"] = tol["grad"]
    res = train(run, collect=True)
    states, grads, problems = layout_states(res, run)
    problems = _initial_problems(run, states[0]["param"]) + problems
    decisions, routing = replays(res, run) if run.model.n_experts else (None, [])
    problems += routing
    absent = _absent(states, [n for n, _ in GPT(run.model, device="meta").named_parameters()])
    if absent:  # no state to take the reference's steps from
        return CheckReport(run, tol, [], problems + absent, res)
    ref = reference_steps(run, tol, states, decisions)
    rows, ties, tied = [], 0, 0
    for step, (mine, theirs) in enumerate(zip(res.moe_steps(), ref)):
        for (index, got), want in zip(mine.items(), theirs["moe"]):  # tokens dropped by the capacity: the same
            name = f"step {step} block {index}: {got['dropped']} here, {want.dropped} on one device"
            same = got["dropped"] == want.dropped
            rows.append(Row("dropped", name, abs(got["dropped"] - want.dropped), float(not same),
                            (0.0 if same else float("inf")) if tol["grad"] is not None else None))
            ties, tied = ties + want.ties, tied + want.tied
            problems += [f"routing: step {step}, {m}" for m in want.mismatches]
    for step, (a, r) in enumerate(zip(res.losses, ref)):
        diff = abs(a - r["loss"])
        rel = diff / abs(r["loss"]) if r["loss"] else diff
        rows.append(Row("loss", f"step {step}", diff, rel, None if tol["loss"] is None else rel / tol["loss"]))
    unit = UNIT_ROUNDOFF[str(run.param_dtype).removeprefix("torch.")]
    worst = _tensors(ref, states, grads, tol, {})
    sensitive = {}
    near = max((acc.ratio for acc in worst.values() if acc.ratio is not None), default=0.0)
    if tol["grad"] is not None and near > TRIGGER:  # how far the reference's own last bits move each gradient
        # (playground/sensitivity.py): in float64 and float32, the reference again from weights
        # moved by a unit of roundoff; in float32, bf16 and fp16, judged against float64, one
        # device in the run's own dtype and recipe, whose arithmetic's rounding the backward
        # amplifies and moved weights do not make; a gradient judged at the larger
        again = []
        if tol["weight"]:  # (float64 and float32)
            again.append(reference_steps(run, tol, moved(states, unit, run.seed), decisions))
        if run.dtype != "float64":
            again.append(reference_steps(run, tol, states, decisions, low_precision=True))
        for measured in again:
            for key, t in raised(ref, measured, tol["grad"]).items():
                sensitive[key] = max(sensitive.get(key, 0.0), t)
    if sensitive:
        for (step, name), t in sensitive.items():  # what AdamW can make of gradients within the raised tolerance
            r = ref[step]
            if r["bounds"] is not None and tol["weight"]:
                r["bounds"][name] = step_bounds(r["grads"][name], {k: r["after"][k][name] for k in KINDS}, r["taken"],
                                                r["group"], t, unit)
        worst = _tensors(ref, states, grads, tol, sensitive)
    for step, r in enumerate(ref):  # the balancing biases: a sum of ±γ, rounded in the layout's dtype
        for name, want in r["after"][BUFFER].items():
            got = states[step + 1][BUFFER].get(name)
            if got is None:
                continue
            diff = (got - want).abs().max().item()
            size = want.abs().max().item() + run.model.bias_update_rate
            worst.setdefault(("bias", name), _Worst()).add(step, diff, diff / size,
                                                           None if tol["grad"] is None else diff / (8 * unit * size))
    for what in ("grad", "weight", "moments", "bias"):
        for (w, name), acc in worst.items():
            if w == what:
                rows.append(Row(what, name, acc.abs, acc.rel, acc.ratio, acc.step if run.steps > 1 else None,
                                acc.raised))
    return CheckReport(run, tol, rows, problems, res, ties, tied, sensitive)
