"""Terminal reports of `train` and `check`."""
from __future__ import annotations


from collectives.ledger import human_bytes
from pipeline import build_schedule
from pipeline import table as schedule_text

from .sensitivity import SENSITIVITY
from .summary import communication_classes, label_family, link_classes


def table(header, rows, left: int = 2) -> str:
    """Columns before `left` are text (left-aligned), the rest numbers (right-aligned)."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt([str(h) for h in header]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def _rank_ranges(ranks) -> str:
    out, start, prev = [], None, None
    for r in ranks:
        if start is None:
            start = prev = r
        elif r == prev + 1:
            prev = r
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = r
    out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)


def bytes_per_step(ledger, steps: int) -> str:
    """Per rank and label, calls and bytes per step and the algorithm that moved them;
    numbered labels of one family are merged (`ddp.bucket* (62)`), so are ranks with
    identical rows, and labels that moved no bytes are left out."""
    by_signature: dict = {}
    for ranks, rows in communication_classes(ledger, steps):
        families: dict = {}
        for row in rows:
            fresh = {"calls": 0, "sent": 0, "recv": 0, "alg": set(), "labels": set(), "setup": row["setup"]}
            t = families.setdefault(label_family(row["label"]), fresh)
            t["calls"] += row["calls_per_step"]
            t["sent"] += row["bytes_sent_per_step"]
            t["recv"] += row["bytes_received_per_step"]
            t["alg"].update(row["algorithms"])
            t["labels"].add(row["label"])
        sig = tuple(sorted((k if len(t["labels"]) > 1 else min(t["labels"]), len(t["labels"]), t["calls"], t["sent"],
                            t["recv"], ",".join(sorted(t["alg"])), t["setup"]) for k, t in families.items()))
        by_signature.setdefault(sig, []).extend(ranks)
    by_signature = {sig: sorted(ranks) for sig, ranks in by_signature.items()}
    rows = []
    for sig, ranks in sorted(by_signature.items(), key=lambda kv: kv[1][0]):
        for label, n, calls, sent, recv, alg, setup in sig:
            name = f"{label} ({n})" if n > 1 else label
            rows.append([_rank_ranges(ranks), name + (" (setup, once)" if setup else ""), alg, f"{calls:g}",
                         human_bytes(sent), human_bytes(recv)])
    if not rows:
        return "(no bytes moved: a single rank)"
    return table(["ranks", "label", "algorithm", "calls/step", "sent/step", "received/step"], rows, left=3)


def links_table(ledger, steps: int, hardware: str) -> str:
    """Bytes each class of ranks sends per step within its node and across nodes, on the
    profile's nodes (gpus_per_node)."""
    from simulator.hardware import load_hardware
    gpn = load_hardware(hardware).gpus_per_node
    rows = [[_rank_ranges(ranks), human_bytes(within), human_bytes(across)]
            for ranks, within, across in link_classes(ledger, steps, gpn)]
    return (f"\nbytes sent per rank per step by link ({gpn} GPUs per node: NVLink within a node, the network "
            f"across nodes):\n" + table(["ranks", "within a node", "across nodes"], rows, left=3))


def train_summary(res) -> str:
    run, cfg = res.run, res.run.model
    lines = [
        f"\nplayground train: {run.layout.describe()}, model {cfg.n_params():,} parameters "
        f"(d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads), backend {run.backend}, {run.dtype}"
        + ((" under autocast" if run.autocast else " (bf16 compute copies of fp32 masters)")
           if run.dtype == "bfloat16" else ""),
        f"data: {res.data}" + (f"; resumed from {run.resume} after step {res.start}" if run.resume else ""),
        f"global batch: {run.layout.global_batch} sequences × {cfg.seq_len} tokens = {run.tokens_per_step:,} tokens/step "
        f"(dp {run.layout.dp} × {run.layout.microbatches} microbatches × {run.layout.micro_batch_size} sequences)",
        "",
    ]
    shown = sorted({0, len(res.losses) - 1, *range(0, len(res.losses), max(1, len(res.losses) // 8))})
    rows = []
    for i in shown:
        gap = f"{res.losses[i] - res.loss_floor:+.4f}" if res.loss_floor is not None else "-"
        rows.append([res.start + i + 1, f"{res.losses[i]:.4f}", gap])
    lines.append(table(["step", "loss", "above floor"], rows, left=0))
    final = res.losses[-1]
    if res.loss_floor is not None:
        lines.append(f"\nfinal loss {final:.4f}; floor {res.loss_floor:.4f} (entropy rate of the source): "
                     f"{final - res.loss_floor:+.4f} above it")
    else:
        lines.append(f"\nfinal loss {final:.4f}")
    tflops = res.tokens_per_s * cfg.flops_per_token() / run.layout.world / 1e12
    lines.append(f"throughput: {res.tokens_per_s:,.0f} tokens/s (median step, {'device' if res.device_step_times else 'wall'} clock, "
                 f"{len(res.losses)} steps in {res.wall_s:.1f} s end to end), "
                 f"{tflops:.3g} model TFLOP/s per rank")
    if run.dtype == "float16":
        lines.append(loss_scaling(res))
    if run.faults or res.restarts or res.values[0].get("skipped_steps"):
        lines.append(faults_table(res))
    if cfg.n_experts:
        lines.append(moe_table(res))
    if run.layout.pp > 1:
        lines.append(schedule_table(run.layout))
    if run.hardware:
        lines.append(simulated_time(res))
    elif run.backend == "sim":
        lines.append("\nsimulated time: --hardware h100-sxm (or a100-80gb, h200) times the step on those GPUs: its "
                     "compute, the host, exposed communication" + (", the pipeline's bubble" if run.layout.pp > 1 else "")
                     + " and the activations in memory")
    if res.values[0].get("memory"):
        lines.append(memory_table(res))
    lines.append("\ncommunication per rank per step (from the ledger):")
    lines.append(bytes_per_step(res.ledger, len(res.losses)))
    if run.hardware and run.layout.world > 1:
        lines.append(links_table(res.ledger, len(res.losses), run.hardware))
    return "\n".join(lines)


def loss_scaling(res) -> str:
    """fp16's dynamic loss scaling (Micikevicius et al. 2018): the scale after the last step,
    and the steps the scaler skipped for an overflow (an inf or a NaN in a gradient on any
    rank of the model: no update anywhere, the scale halved)."""
    v = res.values[0]
    steps = v.get("overflow_steps") or []
    skipped = (f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} skipped for an overflow (an inf or "
               f"a NaN in a gradient on some rank: no update on any rank, the scale halved)" if steps
               else "no step overflowed")
    return f"fp16 loss scaling: scale {v.get('loss_scale'):,.0f} after the last step; {skipped}"


def faults_table(res) -> str:
    """Each injected fault (and each failure that stopped a launch): how it was found, how the
    run recovered, and what it cost (playground/faults.py; training.Restart)."""
    run = res.run
    # the faults that stopped a launch (each restart removed its own from the run's), then the rest
    rows = [[r.fault, r.detected, f"restart from step {r.resumed_from}" + (f" on {r.layout}" if r.layout else ""),
             r.steps_recomputed, f"{r.wall_lost_s:.2f} s", f"{r.sim_lost_s * 1e3:.2f} ms" if r.sim_lost_s is not None
             else "-"] for r in res.restarts]
    skipped = res.values[0].get("skipped_steps") or []
    for f in sorted(run.faults, key=lambda f: (f.step, f.rank)):
        if f.kind == "slow":
            rows.append([str(f), "a straggler: " + _straggler(res, f), "none needed", 0, "-", "-"])
        elif f.kind == "nan" and f.step in (res.values[0].get("overflow_steps") or []):
            rows.append([str(f), "the fp16 loss scaler's overflow check", "the step skipped on every rank, the loss "
                         "scale halved", 0, "-", "-"])
        elif f.kind == "nan":  # (in an earlier launch, before a restart, the check found it just the same)
            found = f.step in skipped or (run.on_nan == "skip" and f.step <= res.start)
            rows.append([str(f), "NaN check before the optimizer step" if run.on_nan != "off" else "not checked",
                         "the step skipped on every rank" if found else "-", 0, "-", "-"])
        elif f.step > run.steps or f.step <= res.start:
            rows.append([str(f), "never reached (outside this run's steps)", "-", 0, "-", "-"])
    return ("\nfaults (steps counted from 1; lost: from the last checkpoint written to the failure found, the "
            "detection included):\n" + table(["fault", "detected", "recovery", "steps recomputed", "wall time lost",
                                              "simulated time lost"], rows))


def _straggler(res, fault) -> str:
    """The other ranks' median idle time per step once `fault`'s rank runs slow (simulated time)."""
    if not res.run.hardware:
        return "the others wait for it (add --hardware to see their idle time)"
    first = max(0, fault.step - 1 - res.start)
    idle = sorted(s["idle"] for r, v in enumerate(res.values) if r != fault.rank and v
                  for s in v["sim_steps"][first:])
    return f"the others idle {idle[len(idle) // 2] * 1e3:.2f} ms a step (simulated)" if idle else "-"


def moe_table(res) -> str:
    """Routing per step (every MoE layer together: tokens routed per expert over every rank
    before the capacity, the fraction dropped by the capacity, the auxiliary losses summed
    over the layers), then each layer at the last step."""
    steps = res.moe_steps()

    def row(name, layer, layers):
        routed = [n for st in layers for n in st["routed"]]
        mean = sum(routed) / len(routed)
        assignments = sum(st["assignments"] for st in layers)
        dropped = sum(st["dropped"] for st in layers)
        return [name, layer, f"{min(routed)}", f"{mean:.1f}", f"{max(routed)}", f"{max(routed) / mean:.2f}" if mean else "-",
                f"{100 * dropped / assignments:.1f}%" if assignments else "-",
                f"{sum(st['aux'] for st in layers):.5f}", f"{sum(st['z'] for st in layers):.5f}"]
    shown = sorted({0, len(steps) - 1, *range(0, len(steps), max(1, len(steps) // 8))})
    rows = [row(f"step {k + 1}", "all", list(steps[k].values())) for k in shown]
    rows += [row(f"step {len(steps)}", f"block {index}", [st]) for index, st in steps[-1].items()]
    c = res.run.model
    cf = f"capacity factor {c.capacity_factor:g}" if c.capacity_factor else "dropless"
    header = ["", "layer", "min", "mean", "max", "max/mean", "dropped", "aux loss", "z loss"]
    biased = c.bias_update_rate > 0
    if biased:  # the balancing bias after the step: its spread over the experts
        header += ["bias min", "bias max"]
        for r, k in zip(rows, shown + [len(steps) - 1] * len(steps[-1])):
            step_layers = list(steps[k].values()) if r[1] == "all" else [steps[k][int(r[1].split()[1])]]
            values = [b for st in step_layers for b in st.get("bias") or []]
            r += [f"{min(values):+.4f}", f"{max(values):+.4f}"] if values else ["-", "-"]
    shared = f", {c.n_shared_experts} shared" if c.n_shared_experts else ""
    width = f" of width {c.expert_width}" if c.expert_d_ff else ""
    how = f"{c.router.replace('_', '-')} router" + (f", bias moved {c.bias_update_rate:g} a step" if biased else "") \
        + f", {c.aux_loss}-wise balance loss"
    text = (f"\nexperts: {c.n_experts}{width} per MoE block{shared}, top-{c.top_k}, {cf}, {how} (tokens routed per "
            f"expert over every rank before the capacity; dropped: assignments past an expert's capacity in a rank's "
            f"token group):\n" + table(header, rows))
    if c.n_experts <= 16:  # each expert at the last step (experts.png draws every step)
        lines = []
        for index, st in steps[-1].items():
            lines.append([f"block {index}", "load"] + [str(n) for n in st["routed"]])
            if st.get("bias") is not None:
                lines.append(["", "bias"] + [f"{b:+.3f}" for b in st["bias"]])
        text += (f"\nper expert at step {len(steps)}:\n"
                 + table(["", ""] + [f"e{i}" for i in range(c.n_experts)], lines))
    return text


def schedule_table(layout) -> str:
    """The pipeline schedule each rank runs, as a table (compute actions; long ones cut)."""
    text = schedule_text(build_schedule(layout.schedule, layout.pp, layout.microbatches, layout.virtual_stages))
    lines = [ln if len(ln) <= 160 else ln[:157] + "..." for ln in text.splitlines()]
    out = (f"\npipeline schedule {layout.schedule} (F forward, B backward, I input grad, W weight grad; "
           f"microbatch.chunk):\n" + "\n".join(lines))
    p, m = layout.pp, layout.microbatches
    if m < p:  # (GPipe's and 1F1B's bubble, Narayanan et al. 2021, section 2.2)
        out += (f"\n{m} microbatch{'es' if m > 1 else ''} for {p} stages: each stage idles while the others work (a bubble of "
                f"(p - 1)/(m + p - 1) = {(p - 1) / (m + p - 1):.0%} of the step); --microbatches {4 * p} fills the "
                f"pipeline")
    return out


def simulated_time(res) -> str:
    """Median simulated step per class of ranks with identical figures (as the bytes table
    merges them), split into compute, the device waiting for the host, exposed
    communication and idle (waiting for peers): every class up to 8, else those of rank 0,
    the slowest rank and the one that computes most."""
    def median_step(steps):
        ordered = sorted(steps, key=lambda b: b["time"])
        return ordered[len(ordered) // 2]
    per_rank = [median_step(v["sim_steps"]) for v in res.values]
    n = len(per_rank)
    slowest = max(range(n), key=lambda r: per_rank[r]["time"])
    busiest = max(range(n), key=lambda r: per_rank[r]["compute"])
    pipeline = res.run.layout.pp > 1
    keys = ("time", "compute", "host", "exposed_comm", "idle") + (("bubble",) if pipeline else ())
    classes: dict = {}
    for r, b in enumerate(per_rank):
        classes.setdefault(tuple(f"{b[k] * 1e3:.3f} ms" for k in keys), []).append(r)
    shown = list(classes.items())
    if len(shown) > 8:
        shown = [c for c in shown if {0, slowest, busiest} & set(c[1])]
    rows = []
    for cells, ranks in sorted(shown, key=lambda c: c[1][0]):
        tags = [t for t, k in (("slowest", slowest), ("most compute", busiest)) if k in ranks and n > 1
                and len(classes) > 1]
        name = ("rank " if len(ranks) == 1 else "ranks ") + _rank_ranges(ranks)
        rows.append([name + (f" ({', '.join(tags)})" if tags else ""), *cells])
    tokens = res.run.tokens_per_step / per_rank[slowest]["time"]
    return (f"\nsimulated on {res.run.hardware} (median step; roofline per op behind a host issuing one op per "
            f"kernel floor, alpha-beta per collective; host: the device waiting for the host): "
            f"{tokens:,.0f} tokens/s\n" + table(["", "step", "compute", "host", "exposed comm", "idle"]
                                                + (["of it pipeline bubble"] if pipeline else []), rows, left=1))


# the peak total by category at the moment of the peak (MemoryTracker.snapshot's at_peak):
# the table and the plots show this one split, whose parts sum to the peak
MEMORY_AT_PEAK = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer",
                  "activations": "activations", "temporaries": "backward temporaries", "comm_buffers": "comm buffers"}


def memory_at_peak(m: dict) -> dict:
    """{category label: bytes} of a memory snapshot at its peak; the values sum to peak_total."""
    return {label: m["at_peak"][key] for key, label in MEMORY_AT_PEAK.items()}


def memory_table(res) -> str:
    """Each rank's peak by category at the moment of the peak, for rank 0 and the rank with
    the largest peak. Model states are measured from the tensors; activations and backward's
    temporaries only with simulated time (--hardware)."""
    per_rank = [v["memory"] for v in res.values]
    top = max(range(len(per_rank)), key=lambda r: per_rank[r]["peak_total"])
    hw = res.run.hardware
    capacity = None
    if hw:
        from simulator.hardware import load_hardware
        capacity = load_hardware(hw).hbm_capacity
    rows = []
    for r in sorted({0, top}):
        m = per_rank[r]
        parts = [human_bytes(x) if hw or k not in ("activations", "backward temporaries") else "-"
                 for k, x in memory_at_peak(m).items()]
        row = [f"rank {r}" + (" (largest peak)" if r == top and len(per_rank) > 1 else ""), *parts,
               human_bytes(m["peak_total"])]
        rows.append(row + ([f"{100 * m['peak_total'] / capacity:.2f}%"] if hw else []))
    header = ["", *MEMORY_AT_PEAK.values(), "peak total"]
    note = "activations as saved for backward" if hw else "activations with --hardware"
    cuda = [f"rank {r}: {human_bytes(v['cuda_peak_allocated'])}" for r, v in enumerate(res.values)
            if v and "cuda_peak_allocated" in v]
    return (f"\nmemory per rank at its peak (what the peak held, by category: the parts sum to it; model states "
            f"measured from the tensors; {note}):\n"
            + table(header + ([f"of {human_bytes(capacity)}"] if hw else []), rows, left=1)
            + (f"\nmeasured peak allocated by torch.cuda (everything, activations included): {', '.join(cuda)}"
               if cuda else ""))


def _of_tolerance(r) -> str:
    if r.ratio is None:
        return "not judged"
    return "inf" if r.ratio == float("inf") else f"{r.ratio:.2e}"


def margin_text(ratio: float) -> str:
    """How far an error is from its tolerance: 'margin 31x' below it, '12x over' above."""
    if ratio == 0:
        return "exact"
    if ratio == float("inf"):
        return "over (no tolerance)"
    return f"margin {1 / ratio:,.3g}x" if ratio <= 1 else f"{ratio:,.3g}x over"


def check_summary(rep, verbose: bool = True) -> str:
    run = rep.run
    tol = rep.tolerance
    lines = [f"\nplayground check: {run.layout.describe()} in {run.dtype} against one device in float64, "
             f"{run.steps} AdamW steps, backend {run.backend}"]
    rows = []
    for r in rep.rows:
        if r.what == "dropped":  # tokens the capacity dropped, layout against reference
            if verbose or not r.ok:
                rows.append([r.what, r.name, f"{r.max_abs:.0f}", "-", "equal" if r.ratio is not None else "not judged",
                             "-", "ok" if r.ok else "FAIL"])
            continue
        if verbose or not r.ok or r.what == "loss":
            rule = ("per element" if tol["weight"] else "not judged") if r.what in ("weight", "moments") else \
                ("8 units" if r.ok or r.ratio is not None else "not judged") if r.what == "bias" else \
                f"{r.raised:.1e} (sensitivity)" if r.raised is not None else \
                (f"{tol[r.what]:.1e}" if tol[r.what] is not None else "not judged")
            rows.append([r.what, r.label, f"{r.max_abs:.3e}", f"{r.max_rel:.3e}", rule, _of_tolerance(r),
                         "ok" if r.ok else "FAIL"])
    lines.append(table(["quantity", "tensor", "max abs err", "max rel err", "tolerance", "of tolerance", ""], rows))
    lines.append("(each step of the reference is taken from the layout's state before it; the worst step is named. "
                 "rel: loss, gradients and moments over max |reference|; weights over the reference step's update; "
                 "loss and gradients are judged against the tolerance, each element of the weights and AdamW's "
                 "moments against what AdamW can make of gradients within theirs; of tolerance: the worst error over "
                 "its tolerance, at most 1 passes; dropped: tokens the experts' capacity dropped, the difference in "
                 "count" + ("; bias: each MoE layer's balancing bias after the step, judged within 8 units of "
                        "roundoff of its size" if run.model.bias_update_rate else "") + ")")
    if rep.ties:
        what = f"{rep.tied} assignment(s) kept otherwise" if rep.tied else "equal-priority assignments in another order"
        lines.append(f"routing: {rep.ties} token group(s) broke a near-tie otherwise than one device ({what}; router "
                     f"scores within {tol['routing']:.1e}); the reference replayed the layout's decisions there")
    if rep.sensitive:
        most = max(rep.sensitive.values()) / tol["grad"]
        how = " or ".join((["the reference ran again from weights moved by a unit of roundoff"]
                           if run.dtype in ("float32", "float64") else []) +
                          ([f"one device ran in {run.dtype} (the run's recipe) instead of float64"]
                           if run.dtype != "float64" else []))
        lines.append(f"sensitivity: {len(rep.sensitive)} gradient(s) at some step moved further than the fixed "
                     f"tolerance when {how}; judged there at {SENSITIVITY}x that move (up to {most:.3g}x the fixed "
                     f"tolerance; playground/sensitivity.py)")
    for p in rep.problems:
        lines.append(f"PROBLEM: {p}")
    unjudged = [w for w in ("grad", "weight") if not tol.get(w)]
    if unjudged:
        lines.append(f"(not judged in {run.dtype}: {', '.join({'grad': 'gradients', 'weight': 'weights and moments'}[w] for w in unjudged)}"
                     + ("; experts route differently near ties than in float64" if run.model.n_experts else "")
                     + "; prove a layout in float64)")
    judged = [r for r in rep.rows if r.ratio is not None]
    closest = max(judged, key=lambda r: r.ratio) if judged else None
    verdict = "PASS" if rep.passed else "FAIL"
    if closest is None:
        lines.append(f"\n{verdict}: nothing judged" + (" (see the problems above)" if rep.problems else ""))
        return "\n".join(lines)
    worst = {w: rep.worst(w) for w in ("loss", "grad", "weight")}
    errors = ", ".join(f"{label} {worst[w].max_rel:.2e}" + (f" ({worst[w].label})" if w != "loss" else "")
                       + (" not judged" if w in unjudged else "")
                       for w, label in (("loss", "loss"), ("grad", "gradient"), ("weight", "weight")) if worst[w])
    lines.append(f"\n{verdict}: worst relative errors: {errors}; closest to its tolerance: {closest.what} "
                 f"{closest.label} at {_of_tolerance(closest)} of it ({margin_text(closest.ratio)})")
    return "\n".join(lines)
