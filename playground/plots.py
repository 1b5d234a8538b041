"""PNG plots of a training run (matplotlib, Agg backend: no display needed).

- timeline.png: simulated time of the last step per rank (needs --hardware): what the
  compute stream's time went to (kernels, waiting for the host, idle, the pipeline's bubble,
  exposed communication) over the communication calls;
- bytes.png: bytes sent per rank per step, stacked by label family (pipeline stages
  merged; the largest dozen families drawn, the rest as "other"; families that moved
  nothing left out), in the unit that suits the size;
- memory.png: each rank's peak memory by category at the moment of the peak, the split
  the report's table prints (needs --hardware); a plan's adds its HBM and the share that fits;
- loss.png: the loss curve against the source's floor;
- schedule.png: with --pp, the pipeline schedule as the classic picture (ranks by time,
  forward and backward boxes numbered by microbatch, equal stage costs);
- check.png (`playground check --plots`): each tensor's relative error against the
  tolerance, gradients and weights;
- experts.png: with experts, each MoE layer's load per expert over the steps (tokens
  routed to it over every rank, before the capacity, over the mean): heatmaps on one
  shared colour scale.

At scale (a plan of 1024 ranks) bars are per class of identical ranks, and the timeline and
the schedule draw at most 32 ranks, evenly spaced.

Every series has its own colour (however many labels), legends sit outside the plot.
"""
from __future__ import annotations

import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from pipeline import build_schedule  # noqa: E402
from .summary import label_family  # noqa: E402
from pipeline.schedules import timeline as schedule_timeline  # noqa: E402

# what the compute stream's time went to (simulator/clock.py, the timeline), and the calls
SPAN_COLORS = {"compute": "#4C72B0", "host": "#9E9E9E", "idle": "#E8D9A8", "bubble": "#F2F2F2",
               "exposed": "#C44E52", "comm": "#DD8452"}
SPAN_NAMES = {"compute": "compute (kernels)", "host": "waiting for the host to issue", "idle": "idle: waiting for peers",
              "bubble": "pipeline bubble", "exposed": "exposed communication", "comm": "communication calls (lower bar)"}


def timeline(res, path: str, ranks=None) -> None:
    """The last step's window on every rank (or `ranks`): the compute stream split into what
    its time went to (kernels, waiting for the host, idle, the pipeline's bubble, exposed
    communication), and the communication calls beneath it."""
    clocks = res.clocks
    shown = list(range(len(clocks))) if ranks is None else list(ranks)
    if len(shown) > 32:  # thinned to 32 evenly spaced ranks, the first and the last kept
        shown = [shown[i] for i in sorted({round(k * (len(shown) - 1) / 31) for k in range(32)})]
    end = max(clocks[r].now for r in shown)
    start = end - max(res.values[r]["sim_steps"][-1]["time"] if "sim_steps" in res.values[r]
                      else res.values[r]["step"]["time"] for r in shown)
    n = len(shown)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.55 * n))
    for i, r in enumerate(shown):
        y = n - 1 - i
        by_kind: dict = {}
        for kind, _, a, b in clocks[r].events:
            if b > start:
                by_kind.setdefault(kind, []).append(((max(a, start) - start) * 1e3, (b - max(a, start)) * 1e3))
        for kind, spans in by_kind.items():
            ax.broken_barh(spans, (y + 0.05, 0.4), facecolor=SPAN_COLORS[kind],
                           edgecolor="#BBBBBB" if kind == "bubble" else "none", linewidth=0.3)
        calls = [e for e in res.ledger.for_rank(r) if e.end is not None and e.end > start]
        ax.broken_barh([((max(e.start, start) - start) * 1e3, (e.end - max(e.start, start)) * 1e3) for e in calls],
                       (y - 0.45, 0.4), facecolor=SPAN_COLORS["comm"])
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in reversed(shown)], fontsize=8 if n <= 16 else 6)
    ax.set_xlabel("simulated time in the last step (ms)")
    ax.set_xlim(0, (end - start) * 1e3)
    ax.legend(handles=[matplotlib.patches.Patch(facecolor=c, edgecolor="#BBBBBB", label=SPAN_NAMES[k])
                       for k, c in SPAN_COLORS.items()], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0)
    ax.set_title(f"Last step on {res.run.hardware}, per rank: what the compute stream's time went to (upper bar) "
                 f"and the communication calls (lower bar)", fontsize=9)
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


def _unit(largest: float) -> tuple:
    """(divisor, name): the binary unit that writes `largest` bytes with one to four digits."""
    for power, name in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if largest >= 1024**power:
            return 1024**power, name
    return 1, "B"


def _stacked_per_rank(series: dict, ylabel: str, title: str, path: str, ticks=None, lines=()) -> None:
    """One bar per rank (or per class of ranks, named by `ticks`), stacked by the series
    ({name: one value per bar}); `lines`: (value, label, style) drawn across."""
    n = len(next(iter(series.values())))
    fig, ax = plt.subplots(figsize=(min(max(6, 0.5 * n + 3), 16), 4))
    bottom = [0.0] * n
    for (name, vals), color in zip(series.items(), distinct_colors(len(series))):
        ax.bar(range(n), vals, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for value, label, style in lines:
        ax.axhline(value, color="black", linestyle=style, linewidth=1, label=label)
    ax.set_xticks(range(n))
    if ticks is not None:
        ax.set_xticklabels(ticks, rotation=45 if n > 6 else 0, ha="right" if n > 6 else "center", fontsize=8)
    elif n > 32:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=16))
    ax.set_xlabel("rank" if ticks is None else "ranks (one bar per class of identical ranks)")
    ax.set_ylabel(ylabel)
    top = max([*bottom, *(v for v, _, _ in lines)])
    ax.set_ylim(0, top * 1.08 if top > 0 else 1)  # the tallest bar is not clipped
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    _save(fig, path)


LEGEND_MAX = 12  # families of labels drawn one by one; the rest share "other"


def plot_family(label: str) -> str:
    """A label's family for a plot: numbered labels merged (label_family) and the pipeline
    stage dropped (`zero.pp16.grads.unit3` -> `zero.grads.unit*`): a rank's bar holds its own
    stages, and 70B on 1024 ranks keeps a dozen families instead of 170."""
    return re.sub(r"\.pp\d+", "", label_family(label))


def _by_family(per_rank: list, scale: float) -> dict:
    """{family: bytes per bar / scale} from [{label: bytes}] per bar: families that moved
    nothing left out, the largest LEGEND_MAX kept and the rest summed as "other"."""
    fams: dict = {}
    for i, labels in enumerate(per_rank):
        for label, b in labels.items():
            fams.setdefault(plot_family(label), [0.0] * len(per_rank))[i] += b
    fams = {f: v for f, v in fams.items() if any(v)}
    ranked = sorted(fams, key=lambda f: -sum(fams[f]))
    out = {f: [x / scale for x in fams[f]] for f in sorted(ranked[:LEGEND_MAX])}
    rest = ranked[LEGEND_MAX:]
    if rest:
        out[f"other ({len(rest)} families)"] = [sum(fams[f][i] for f in rest) / scale for i in range(len(per_rank))]
    return out


def bytes_by_label(res, path: str) -> None:
    steps = len(res.losses)
    per_rank = res.ledger.totals("label")
    sent = [{k: t.bytes_sent / steps for k, t in per_rank[r].items()} for r in range(len(per_rank))]
    scale, unit = _unit(max([sum(s.values()) for s in sent] + [1]))
    series = _by_family(sent, scale)
    if not series:
        return False  # (a single rank: nothing moved)
    _stacked_per_rank(series, f"{unit} sent per step",
                      "Bytes each rank sends per step, by ledger label (setup spread over the steps)", path)
    return True


def memory(res, path: str) -> None:
    from .report import memory_at_peak
    per_rank = [memory_at_peak(v["memory"]) for v in res.values]
    scale, unit = _unit(max(v["memory"]["peak_total"] for v in res.values))
    series = {name: [m[name] / scale for m in per_rank] for name in per_rank[0]}
    _stacked_per_rank(series, unit, "Each rank's peak memory by category at the moment of the peak (the table's "
                                    "split)", path)


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
    action a box placed by `timeline` with equal stage costs, labelled with its microbatch
    (and chunk) where the box is wide enough to hold it; white gaps are the bubble. Past 32
    ranks, rows are thinned to 32 evenly spaced ones (the first and the last kept)."""
    layout = res.run.layout
    p, v = layout.pp, layout.virtual_stages
    spans = schedule_timeline(build_schedule(layout.schedule, p, layout.microbatches, v), p, v)
    end = max(e for row in spans for _, _, e in row)
    bubble = 1 - sum(e - s for row in spans for _, s, e in row) / (p * end)
    rows = sorted({round(i * (p - 1) / 31) for i in range(32)}) if p > 32 else list(range(p))
    width = min(4 + end * 0.45, 24)
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.45 * len(rows)))
    box_px = 0.8 * (width - 2) * 120 / end  # pixels per unit of time at the saved dpi (the axes: 80% of the figure)
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        by_kind: dict = {}
        for a, start, stop in spans[r]:
            by_kind.setdefault(a.kind, []).append((start, stop - start))
            text = f"{a.kind}{a.microbatch}" + (f".{a.chunk}" if v > 1 else "")
            if (stop - start) * box_px >= 9 * len(text) + 4:
                ax.text((start + stop) / 2, y, text, ha="center", va="center", fontsize=7, color="white")
        for kind, boxes in by_kind.items():
            ax.broken_barh(boxes, (y - 0.4, 0.8), facecolor=KIND_COLORS[kind], edgecolor="white",
                           linewidth=0.5 if box_px > 4 else 0)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(rows)], fontsize=8 if len(rows) <= 16 else 6)
    ax.set_xlim(0, end)
    ax.set_xlabel("time (units: one forward of a whole stage)")
    ax.legend(handles=[matplotlib.patches.Patch(facecolor=c, label=n) for k, c, n in
                       (("F", KIND_COLORS["F"], "forward"), ("B", KIND_COLORS["B"], "backward"),
                        ("I", KIND_COLORS["I"], "input gradient"), ("W", KIND_COLORS["W"], "weight gradient"))
                       if any(a.kind == k for row in spans for a, _, _ in row)],
              fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(f"{layout.schedule}: pp={p}, {layout.microbatches} microbatches"
                 + (f", {v} chunks per rank" if v > 1 else "") + f"; bubble {bubble:.0%}"
                 + (f" ({len(rows)} of the {p} ranks drawn)" if len(rows) < p else ""), fontsize=9)
    _save(fig, path)


def expert_load(res, path: str) -> None:
    """Tokens routed to each expert over the steps, over the mean, one heatmap per MoE block
    on one shared colour scale (one colour bar for all); with a balancing bias, beside each
    its bias per expert after each step (a diverging scale, zero white)."""
    steps = res.moe_steps()
    layers = sorted(steps[0])
    loads = {index: [[n / (sum(st[index]["routed"]) / len(st[index]["routed"])) for n in st[index]["routed"]]
                     for st in steps] for index in layers}
    biased = all(st[index].get("bias") is not None for st in steps for index in layers)
    top = max(x for load in loads.values() for row in load for x in row)
    reach = max((abs(b) for st in steps for index in layers for b in st[index].get("bias") or []), default=0) or 1e-3
    cols = 2 if biased else 1
    fig, axes = plt.subplots(len(layers), cols, figsize=(cols * max(6, 0.25 * len(steps) + 3), 1.2 + 1.1 * len(layers)),
                             squeeze=False, sharex=True)
    im = bias_im = None
    extent = (0.5, len(steps) + 0.5, -0.5, res.run.model.n_experts - 0.5)
    for row, index in zip(axes, layers):
        load = loads[index]
        im = row[0].imshow(list(map(list, zip(*load))), aspect="auto", cmap="viridis", origin="lower", vmin=0,
                           vmax=top, extent=extent)
        row[0].set_ylabel(f"block {index}\nexpert")
        if biased:
            bias = [st[index]["bias"] for st in steps]
            bias_im = row[1].imshow(list(map(list, zip(*bias))), aspect="auto", cmap="coolwarm", origin="lower",
                                    vmin=-reach, vmax=reach, extent=extent)
    fig.colorbar(im, ax=list(axes[:, 0]), label="load / mean (one scale for every block)")
    if biased:
        fig.colorbar(bias_im, ax=list(axes[:, 1]), label="bias after the step")
        axes[0, 1].set_title(f"balancing bias (moved {res.run.model.bias_update_rate:g} a step)", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
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
        if fn(res, path) is not False:
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


def write_plan_plots(p, directory: str, headroom: float | None = None) -> list:
    """A plan's pictures (playground/planning.py), one bar per class of ranks with identical
    figures: the step split, memory by category at the peak against the HBM and the share a
    layout may use (`headroom`: playground/fits.py), bytes sent per step by label family; the
    timeline of the ranks that ran; the schedule with a pipeline."""
    from simulator import load_hardware

    from .fits import DEFAULT_HEADROOM
    from .planning import _classes
    from .report import _rank_ranges, memory_at_peak
    headroom = DEFAULT_HEADROOM if headroom is None else headroom
    hw = load_hardware(p.run.hardware)
    os.makedirs(directory, exist_ok=True)
    per_rank = p.ledger.totals("label")
    step_keys = {"compute": "compute", "host": "waiting for the host", "exposed_comm": "exposed communication",
                 "idle": "idle (bubble, waits)"}
    mem_names = list(memory_at_peak(p.values[0]["memory"]))
    rows = [(*(v["step"][k] for k in step_keys), *memory_at_peak(v["memory"]).values(),
             tuple(sorted((k, t.bytes_sent / 2) for k, t in per_rank[r].items())))  # (a plan runs two steps)
            for r, v in enumerate(p.values)]
    classes = _classes(rows)
    ticks = [_rank_ranges(ranks) for ranks, _ in classes]
    col = lambda i: [row[i] for _, row in classes]  # noqa: E731
    written = []
    path = os.path.join(directory, "step.png")
    _stacked_per_rank({name: [x * 1e3 for x in col(i)] for i, name in enumerate(step_keys.values())}, "ms",
                      f"Planned step on {p.run.hardware} per class of ranks", path, ticks)
    written.append(path)
    path = os.path.join(directory, "memory.png")
    first = len(step_keys)
    scale, unit = _unit(max(hw.hbm_capacity, *(sum(row[first:first + len(mem_names)]) for _, row in classes)))
    _stacked_per_rank({name: [x / scale for x in col(first + i)] for i, name in enumerate(mem_names)}, unit,
                      f"Planned peak memory per class of ranks, by category at the peak, against {p.run.hardware}'s HBM",
                      path, ticks, lines=[(hw.hbm_capacity / scale, f"HBM {hw.hbm_capacity / scale:.1f} {unit}", "-"),
                                          (hw.hbm_capacity * (1 - headroom) / scale,
                                           f"fits below {1 - headroom:.0%} (--memory-headroom)", "--")])
    written.append(path)
    sent = [dict(row[-1]) for _, row in classes]
    scale, unit = _unit(max([sum(s.values()) for s in sent] + [1]))
    series = _by_family(sent, scale)
    if series:
        path = os.path.join(directory, "bytes.png")
        _stacked_per_rank(series, f"{unit} sent per step", "Planned bytes each class of ranks sends per step, by "
                                                           "label family", path, ticks)
        written.append(path)
    path = os.path.join(directory, "timeline.png")
    timeline(p, path, ranks=p.ran)
    written.append(path)
    if p.run.layout.pp > 1:
        path = os.path.join(directory, "schedule.png")
        pipeline_schedule(p, path)
        written.append(path)
    return written
