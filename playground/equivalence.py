"""The equivalence check (docs/architecture.md, Contract 5).

The reference model runs on one rank in float64 on the same global batches; the layout
runs in its own dtype. Compared: the loss of every step, every gradient after the first
backward, every weight after the last optimizer step — each gathered to full tensors from
the pieces every rank holds (Contract 4), with replicas checked for agreement.
Errors: max |layout − reference| (abs) and a relative error (rel): for the loss and the
gradients, over max |reference|; for the weights, over the largest change the reference
made to that tensor in its k steps (max |w_k − w_0|). Weights are judged against their
update because AdamW divides by √v: an element whose gradient is near eps, computed with
cancellation, turns float32 rounding of the gradient into an error of up to a few 1e-3
of one update even on a single device (dp=1, measured), while a sharding bug shows as
an error of the order of the whole update. The check fails if a rel error exceeds the
dtype's tolerance. bfloat16 weights after AdamW differ from float64 by about the whole
update on any layout, so they are reported but not judged: prove a layout in float64.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from model import GPT
from model.data import make_source
from model.moe import MoEStats, TokenGroups
from sequence_parallel.balance import positions

from .run_config import RunConfig
from model import assemble
from .training import train

# tolerance of the relative error, by dtype and quantity (None: reported, not judged)
TOLERANCE = {
    "float64": {"loss": 1e-10, "grad": 1e-10, "weight": 1e-10},
    "float32": {"loss": 1e-5, "grad": 1e-5, "weight": 1e-2},
    "bfloat16": {"loss": 2e-2, "grad": 5e-2, "weight": None},
}


@dataclass
class Row:
    what: str  # "loss", "grad", "weight"
    name: str
    max_abs: float
    max_rel: float
    ok: bool  # within tolerance, or not judged


@dataclass
class CheckReport:
    run: RunConfig
    tolerance: dict  # by quantity
    rows: list
    problems: list  # coverage / replica problems from gathering
    result: object = None  # the layout's TrainResult (losses, ledger, memory, ...)

    @property
    def passed(self) -> bool:
        return not self.problems and all(r.ok for r in self.rows)

    def worst(self, what: str) -> Row:
        return max((r for r in self.rows if r.what == what), key=lambda r: r.max_rel)


def reference_run(run: RunConfig) -> dict:
    """Single device, float64, the whole global batch at once: losses, first gradients,
    final weights."""
    cfg, layout = run.model, run.layout
    model = GPT(cfg, seed=run.seed, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, betas=run.betas, weight_decay=run.weight_decay)
    source = make_source(run.data, cfg.vocab_size, run.seed)
    groups = token_groups(run)
    for layer in model.moe_layers():
        layer.groups = groups
    out = {"losses": [], "moe": []}
    for step in range(run.steps):
        for layer in model.moe_layers():
            layer.stats = MoEStats()
        batch = source.global_batch(step, layout.global_batch, cfg.seq_len)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        moe = sum(layer.stats.aux + layer.stats.z for layer in model.moe_layers())  # part of the loss
        out["losses"].append(loss.item() + moe)
        out["moe"].append([layer.stats for layer in model.moe_layers()])
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


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


def initial_weights(run: RunConfig) -> dict:
    return {n: p.detach() for n, p in GPT(run.model, seed=run.seed, dtype=torch.float64).named_parameters()}


def _compare(what, name, got, ref, tol, scale=None) -> Row:
    diff = (got - ref).abs().max().item() if got.numel() else 0.0
    if scale is None:
        scale = ref.abs().max().item() if ref.numel() else 0.0
    rel = diff / scale if scale > 0 else diff
    return Row(what, name, diff, rel, tol is None or rel <= tol)


def checkable(run: RunConfig) -> None:
    """Raise ValueError naming the value when `run` cannot be checked against one device."""
    run.layout.validate(run.model)
    if run.model.attention_dropout:
        raise ValueError(f"check needs attention_dropout=0, not {run.model.attention_dropout}: each rank draws its own "
                         f"dropout masks, so no layout computes one device's numbers")


def check(run: RunConfig) -> CheckReport:
    run = replace(run, progress=False)
    checkable(run)
    tol = dict(TOLERANCE[run.dtype])
    if run.model.n_experts and run.dtype == "bfloat16":
        # bf16 router logits cannot reproduce float64's routing decisions near ties; a token routed
        # or dropped differently moves the experts' gradients by its whole share: reported only
        tol["grad"] = None
    ref = reference_run(run)
    res = train(run, collect=True)
    rows, problems = [], []
    init = initial_weights(run)
    for step, (mine, theirs) in enumerate(zip(res.moe_steps(), ref["moe"])):
        for (index, got), want in zip(mine.items(), theirs):  # tokens dropped by the capacity: the same ones
            name = f"step {step} block {index}: {got['dropped']} here, {want.dropped} on one device"
            same = got["dropped"] == want.dropped
            judged = tol["grad"] is not None
            rows.append(Row("dropped", name, abs(got["dropped"] - want.dropped), float(not same), same or not judged))
    for step, (a, b) in enumerate(zip(res.losses, ref["losses"])):
        rows.append(_compare("loss", f"step {step}", torch.tensor(a, dtype=torch.float64),
                            torch.tensor(b, dtype=torch.float64), tol["loss"]))
    for what, key in (("grad", "grads"), ("weight", "weights")):
        full, probs = assemble([v[key] for v in res.values])
        problems += [f"{what}s: {p}" for p in probs]
        missing = sorted(set(ref[key]) - set(full))
        problems += [f"{what}s: {name} is held by no rank" for name in missing]
        for name, r in ref[key].items():
            if name in full:
                scale = (r - init[name]).abs().max().item() if what == "weight" else None
                rows.append(_compare(what, name, full[name], r, tol[what], scale))
    return CheckReport(run, tol, rows, problems, res)
