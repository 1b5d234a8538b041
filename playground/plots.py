"""PNG plots of a training run (matplotlib, Agg backend: no display needed).

- timeline.png: simulated time of the last step per rank, compute and communication
  streams (needs --hardware);
- bytes.png: bytes sent per rank per step, stacked by ledger label family;
- memory.png: peak memory per rank by category (needs --hardware);
- loss.png: the loss curve against the source's floor;
- schedule.png: with --pp, the pipeline schedule as the classic picture (ranks by time,
  forward and backward boxes numbered by microbatch, equal stage costs);
- check.png (`playground check --plots`): each tensor's relative error against the
  tolerance, gradients and weights;
- experts.png: with experts, each MoE layer's load per expert over the steps (tokens
  routed to it over every rank, before the capacity, over the mean): a heatmap.

Every series has its own colour (however many labels), legends sit outside the plot.
"""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from pipeline import build_schedule  # noqa: E402
from .summary import label_family  # noqa: E402
from pipeline.schedules import timeline as schedule_timeline  # noqa: E402

COLORS = {"compute": "#4C72B0", "comm": "#DD8452"}


def timeline(res, path: str) -> None:
    """The last step's window on every rank: compute segments and communication calls."""
    end = max(c.now for c in res.clocks)
    start = end - max(v["sim_steps"][-1]["time"] for v in res.values)
    n = len(res.clocks)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.55 * n))
    for r, clock in enumerate(res.clocks):
        y = n - 1 - r
        comp = [(a, b - a) for a, b in clock.segments if b > start]
        ax.broken_barh([((a - start) * 1e3, d * 1e3) for a, d in comp], (y + 0.05, 0.4), color=COLORS["compute"])
        calls = [e for e in res.ledger.for_rank(r) if e.end is not None and e.end > start]
        ax.broken_barh([((e.start - start) * 1e3, (e.end - e.start) * 1e3) for e in calls], (y - 0.45, 0.4),
                       color=COLORS["comm"])
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {n - 1 - i}" for i in range(n)])
    ax.set_xlabel("simulated time in the last step (ms)")
    ax.set_title(f"Last step on {res.run.hardware}: compute (blue, upper) and communication (orange, lower) "
                 f"per rank; gaps in blue are waits", fontsize=9)
    _save(fig, path)


def distinct_colors(n: int) -> list:
    """n colours no two alike: tab10, tab20, or evenly spaced hues beyond 20."""
    if n <= 10:
        return [plt.get_cmap("tab10")(i) for i in range(n)]
    if n <= 20:
        return [plt.get_cmap("tab20")(i) for i in range(n)]
    return [plt.get_cmap("hsv")(i / n) for i in range(n)]


def _save(fig, path: str) -> None:
    fig.savefig(path, dpi=120, bbox_inches="tight")  # keeps a legend placed outside the axes
    plt.close(fig)


def _stacked_per_rank(series: dict, ylabel: str, title: str, path: str, ticks=None) -> None:
    """One bar per rank (or per class of ranks, named by `ticks`), stacked by the series
    ({name: one value per bar})."""
    n = len(next(iter(series.values())))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * n + 3), 4))
    bottom = [0.0] * n
    for (name, vals), color in zip(series.items(), distinct_colors(len(series))):
        ax.bar(range(n), vals, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(n))
    if ticks is not None:
        ax.set_xticklabels(ticks, rotation=45 if n > 6 else 0, ha="right" if n > 6 else "center", fontsize=8)
    ax.set_xlabel("rank" if ticks is None else "ranks (one bar per class of identical ranks)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(bottom) * 1.08 if max(bottom) > 0 else 1)  # the tallest bar is not clipped
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _save(fig, path)


def bytes_by_label(res, path: str) -> None:
    steps = len(res.losses)
    per_rank = res.ledger.totals("label")
    families = sorted({label_family(k) for labels in per_rank.values() for k in labels})
    series = {fam: [sum(t.bytes_sent for k, t in per_rank[r].items() if label_family(k) == fam) / steps / 2**20
                    for r in range(len(per_rank))] for fam in families}
    _stacked_per_rank(series, "MiB sent per step",
                      "Bytes each rank sends per step, by ledger label (setup spread over the steps)", path)


def memory(res, path: str) -> None:
    per_rank = [v["memory"] for v in res.values]
    names = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer",
             "peak_activations": "activations (peak)", "peak_comm_buffers": "comm buffers (peak)"}
    series = {label: [m[key] / 2**20 for m in per_rank] for key, label in names.items()}
    _stacked_per_rank(series, "MiB", "Peak memory per rank by category", path)


def loss(res, path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(res.losses) + 1), res.losses, label="loss (mean over the global batch)")
    if res.loss_floor is not None:
        ax.axhline(res.loss_floor, color="gray", linestyle="--", label=f"floor {res.loss_floor:.3f} (entropy rate)")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Training loss")
    ax.legend(fontsize=8)
    _save(fig, path)


KIND_COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#8FBC8F", "W": "#C4A000"}


def pipeline_schedule(res, path: str) -> None:
    """The classic picture of the run's schedule: one row per pipeline rank, each compute
    action a box labelled with its microbatch (and chunk), placed by `timeline` with equal
    stage costs; white gaps are the bubble."""
    layout = res.run.layout
    p, v = layout.pp, layout.virtual_stages
    spans = schedule_timeline(build_schedule(layout.schedule, p, layout.microbatches, v), p, v)
    end = max(e for row in spans for _, _, e in row)
    fig, ax = plt.subplots(figsize=(min(4 + end * 0.45, 24), 1.0 + 0.6 * p))
    for r, row in enumerate(spans):
        y = p - 1 - r
        for a, start, stop in row:
            ax.broken_barh([(start, stop - start)], (y - 0.4, 0.8), facecolor=KIND_COLORS[a.kind], edgecolor="white")
            ax.text((start + stop) / 2, y, f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if v > 1 else ""),
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {p - 1 - i}" for i in range(p)])
    ax.set_xlabel("time (units: one forward of a whole stage)")
    bubble = 1 - sum(e - s for row in spans for _, s, e in row) / (p * end)
    ax.set_title(f"{layout.schedule}: pp={p}, {layout.microbatches} microbatches"
                 + (f", {v} chunks per rank" if v > 1 else "")
                 + f"; F forward, B backward (I input grad, W weight grad); bubble {bubble:.0%}", fontsize=9)
    _save(fig, path)


def expert_load(res, path: str) -> None:
    steps = res.moe_steps()
    layers = sorted(steps[0])
    fig, axes = plt.subplots(len(layers), 1, figsize=(max(6, 0.25 * len(steps) + 3), 1.2 + 1.1 * len(layers)),
                             squeeze=False, sharex=True)
    for ax, index in zip(axes[:, 0], layers):
        load = [[n / (sum(st[index]["routed"]) / len(st[index]["routed"])) for n in st[index]["routed"]]
                for st in steps]
        im = ax.imshow(list(map(list, zip(*load))), aspect="auto", cmap="viridis", origin="lower",
                       extent=(0.5, len(steps) + 0.5, -0.5, len(load[0]) - 0.5))
        ax.set_ylabel(f"block {index}\nexpert")
        fig.colorbar(im, ax=ax, label="load / mean")
    axes[-1, 0].set_xlabel("step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle("Tokens routed to each expert (over every rank, before the capacity), over the mean", fontsize=9)
    _save(fig, path)


def write_plots(res, directory: str) -> list:
    os.makedirs(directory, exist_ok=True)
    written = []
    if res.run.model.n_experts:
        path = os.path.join(directory, "experts.png")
        expert_load(res, path)
        written.append(path)
    if res.run.layout.pp > 1:
        path = os.path.join(directory, "schedule.png")
        pipeline_schedule(res, path)
        written.append(path)
    for name, fn, needs_time in (("loss.png", loss, False), ("bytes.png", bytes_by_label, False),
                                 ("timeline.png", timeline, True), ("memory.png", memory, True)):
        if needs_time and not res.clocks:
            continue
        path = os.path.join(directory, name)
        fn(res, path)
        written.append(path)
    return written


def write_check_plot(rep, directory: str) -> str:
    """check.png: every tensor's worst error over its tolerance (log scale) for the
    gradients and the weights; a failing tensor stands above the line at 1. Quantities not
    judged (16-bit runs) show their relative error instead, with no line."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "check.png")
    kinds = [w for w in ("grad", "weight") if any(r.what == w for r in rep.rows)]
    names = [r.name for r in rep.rows if r.what == kinds[0]]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(max(7, 0.28 * len(names) + 2), 2.6 * len(kinds)), squeeze=False,
                             sharex=True)
    floor = 1e-18  # exact zeros drawn at the bottom of the log scale
    for ax, kind, color in zip(axes[:, 0], kinds, distinct_colors(len(kinds))):
        rows = [r for r in rep.rows if r.what == kind]
        judged = all(r.ratio is not None for r in rows)
        values = [min(r.ratio, 1e6) if judged else r.max_rel for r in rows]  # (inf drawn at 1e6)
        ax.bar(range(len(rows)), [max(v, floor) for v in values], color=[color if r.ok else "red" for r in rows])
        if judged:
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="tolerance")
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        ax.set_yscale("log")
        ax.set_ylabel("error / tolerance" if judged else "max rel. error (not judged)")
        ax.set_title(f"{'gradients after the first backward' if kind == 'grad' else 'weights after the last step'}"
                     f" ({'over max |reference|' if kind == 'grad' else 'per element, against AdamW' + chr(39) + 's bound'})",
                     fontsize=9)
    last = axes[-1, 0]
    last.set_xticks(range(len(names)))
    last.set_xticklabels(names, rotation=90, fontsize=6)
    verdict = "PASS" if rep.passed else "FAIL"
    fig.suptitle(f"playground check: {rep.run.layout.describe()}, {rep.run.dtype}: {verdict}", fontsize=10)
    _save(fig, path)
    return path


def write_plan_plots(p, directory: str) -> list:
    """A plan's pictures (playground/planning.py), one bar per class of ranks with identical
    figures: the step split, memory by category against HBM, and bytes sent per step by
    label; the schedule with a pipeline."""
    from simulator import load_hardware

    from .planning import _classes
    from .report import _rank_ranges
    os.makedirs(directory, exist_ok=True)
    per_rank = p.ledger.totals("label")
    families = sorted({label_family(k) for labels in per_rank.values() for k in labels})
    sent = [[sum(t.bytes_sent for k, t in per_rank[r].items() if label_family(k) == f) / 2 for f in families]
            for r in range(len(p.values))]  # (a plan runs two steps)
    mem_keys = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer",
                "peak_activations": "activations (peak)", "peak_comm_buffers": "comm buffers (peak)"}
    step_keys = {"compute": "compute", "host": "waiting for the host", "exposed_comm": "exposed communication",
                 "idle": "idle (bubble, waits)"}
    rows = [(*(v["step"][k] for k in step_keys), *(v["memory"][k] for k in mem_keys), *s)
            for v, s in zip(p.values, sent)]
    classes = _classes(rows)
    ticks = [_rank_ranges(ranks) for ranks, _ in classes]
    col = lambda i: [row[i] for _, row in classes]  # noqa: E731
    written = []
    path = os.path.join(directory, "step.png")
    _stacked_per_rank({name: [x * 1e3 for x in col(i)] for i, name in enumerate(step_keys.values())}, "ms",
                      f"Planned step on {p.run.hardware} per class of ranks", path, ticks)
    written.append(path)
    path = os.path.join(directory, "memory.png")
    _stacked_per_rank({name: [x / 2**30 for x in col(len(step_keys) + i)] for i, name in enumerate(mem_keys.values())},
                      "GiB", f"Planned peak memory per class of ranks ({p.run.hardware} HBM: "
                      f"{load_hardware(p.run.hardware).hbm_capacity / 2**30:.1f} GiB)", path, ticks)
    written.append(path)
    if families:
        path = os.path.join(directory, "bytes.png")
        first = len(step_keys) + len(mem_keys)
        _stacked_per_rank({f: [x / 2**20 for x in col(first + i)] for i, f in enumerate(families)},
                          "MiB sent per step", "Planned bytes each class of ranks sends per step, by ledger label",
                          path, ticks)
        written.append(path)
    if p.run.layout.pp > 1:
        path = os.path.join(directory, "schedule.png")
        pipeline_schedule(p, path)
        written.append(path)
    return written
