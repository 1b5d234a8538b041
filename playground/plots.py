"""PNG plots of a training run (matplotlib, Agg backend: no display needed).

- timeline.png: simulated time of the last step per rank, compute and communication
  streams (needs --hardware);
- bytes.png: bytes sent per rank per step, stacked by ledger label family;
- memory.png: peak memory per rank by category (needs --hardware);
- loss.png: the loss curve against the source's floor;
- schedule.png: with --pp, the pipeline schedule as the classic picture (ranks by time,
  forward and backward boxes numbered by microbatch, equal stage costs).
"""
from __future__ import annotations

import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pipeline import build_schedule  # noqa: E402
from pipeline.schedules import timeline as schedule_timeline  # noqa: E402

COLORS = {"compute": "#4C72B0", "comm": "#DD8452"}


def _family(label: str) -> str:
    m = re.fullmatch(r"(.*\D)\d+", label)
    return m.group(1) + "*" if m else label


def timeline(res, path: str) -> None:
    """The last step's window on every rank: compute segments and communication calls."""
    steps = res.values[0]["sim_steps"]
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
    del steps
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stacked_per_rank(series: dict, ylabel: str, title: str, path: str) -> None:
    """One bar per rank, stacked by the series ({name: one value per rank})."""
    n = len(next(iter(series.values())))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * n + 3), 4))
    bottom = [0.0] * n
    for name, vals in series.items():
        ax.bar(range(n), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(n))
    ax.set_xlabel("rank")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bytes_by_label(res, path: str) -> None:
    steps = len(res.losses)
    per_rank = res.ledger.totals("label")
    families = sorted({_family(k) for labels in per_rank.values() for k in labels})
    series = {fam: [sum(t.bytes_sent for k, t in per_rank[r].items() if _family(k) == fam) / steps / 2**20
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
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Training loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(res, directory: str) -> list:
    os.makedirs(directory, exist_ok=True)
    written = []
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
