"""Machine-readable summaries of `train` and `check` (`--json FILE`), with the schema of
docs/json.md. Tests read these instead of parsing the tables."""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict

SCHEMA_VERSION = 1
# check's JSON: 2 since each step is compared from the layout's state and judged by ratio to its tolerance
CHECK_SCHEMA_VERSION = 2


def label_family(label: str) -> str:
    """Numbered labels of one family (ddp.bucket0, ddp.bucket1, ...) share `ddp.bucket*`."""
    m = re.fullmatch(r"(.*\D)\d+", label)
    return m.group(1) + "*" if m else label


def _setup(label: str) -> bool:
    """Calls made once per run, not per step: DDP's initial broadcast of the weights."""
    return label.startswith("ddp") and label.endswith(".broadcast")


def _per_label(entries, steps: int) -> list:
    """One rank's calls by label: op(s), algorithm(s), calls, bytes sent and received per
    step (setup calls, made once, are not divided by the steps); labels that moved no bytes
    are left out."""
    acc = defaultdict(lambda: {"calls": 0, "sent": 0, "received": 0, "ops": set(), "algorithms": set()})
    for e in entries:
        a = acc[e.label]
        a["calls"] += 1
        a["sent"] += e.bytes_sent
        a["received"] += e.bytes_recv
        a["ops"].add(e.op)
        a["algorithms"].add(e.algorithm)
    out = []
    for label, a in sorted(acc.items()):
        if a["sent"] == 0 and a["received"] == 0:
            continue
        per = 1 if _setup(label) else steps
        out.append({"label": label, "ops": sorted(a["ops"]), "algorithms": sorted(a["algorithms"]),
                    "setup": per == 1, "calls_per_step": a["calls"] / per,
                    "bytes_sent_per_step": a["sent"] / per, "bytes_received_per_step": a["received"] / per})
    return out


def _records(ledger) -> list:
    """[(a rank's entries, the ranks that share that record)]: a plan's ranks share their
    stand-in's record, so 10^5 ranks are walked once."""
    by_record: dict = {}
    for r, entries in enumerate(ledger.per_rank):
        by_record.setdefault(id(entries), (entries, []))[1].append(r)
    return list(by_record.values())


def communication_classes(ledger, steps: int) -> list:
    """[(ranks, rows)]: `_per_label`'s rows, once for each class of ranks whose calls are
    alike."""
    by_rows: dict = {}
    for entries, ranks in _records(ledger):
        rows = _per_label(entries, steps)
        key = json.dumps(rows, sort_keys=True)
        by_rows.setdefault(key, (rows, []))[1].extend(ranks)
    return sorted(((sorted(ranks), rows) for rows, ranks in by_rows.values()), key=lambda c: c[0][0])


def link_classes(ledger, steps: int, gpus_per_node: int) -> list:
    """[(ranks, bytes sent per step within a node, across nodes)], one row per class of
    ranks alike (simulator/cost_model.py, `sent_across_nodes`); setup calls left out."""
    from simulator.cost_model import sent_across_nodes
    rows: dict = {}
    for entries, ranks in _records(ledger):
        across = total = 0
        for e in entries:
            if _setup(e.label):
                continue
            total += e.bytes_sent
            across += sent_across_nodes(e.op, e.algorithm, e.size, e.group, e.rank, e.bytes_sent, gpus_per_node)
        rows.setdefault(((total - across) / steps, across / steps), []).extend(ranks)
    return sorted(((sorted(r), within, across) for (within, across), r in rows.items()), key=lambda c: c[0][0])


def communication(ledger, steps: int) -> list:
    """Per rank and label: `_per_label`'s rows with the rank."""
    out = [{"rank": r, **row} for ranks, rows in communication_classes(ledger, steps) for r in ranks for row in rows]
    return sorted(out, key=lambda row: (row["rank"], row["label"]))


def _run_json(run) -> dict:
    layout = {**run.layout.to_dict(), "world": run.layout.world, "global_batch": run.layout.global_batch}
    if layout.get("stage_layers") is not None:
        layout["stage_layers"] = list(layout["stage_layers"])
    return {
        "layout": layout,
        "model": {**run.model.to_dict(), "n_params": run.model.n_params()},
        "run": {"steps": run.steps, "dtype": run.dtype, "reduce_dtype": run.reduce_dtype, "grad_dtype": run.grad_dtype,
                "backend": run.backend,
                "hardware": run.hardware, "compile": run.compile, "cuda_graphs": run.cuda_graphs,
                "bf16_copies": run.dtype == "bfloat16" and not run.autocast,
                "autocast": run.autocast, "fused_master_step": run.fused_master_step,
                "grad_overlap": run.grad_overlap, "seed": run.seed, "lr": run.lr,
                "data": run.data or "markov", "tokens_per_step": run.tokens_per_step},
    }


def train_json(res) -> dict:
    run = res.run
    steps = len(res.losses)
    out = {"schema": f"playground.train/{SCHEMA_VERSION}", **_run_json(run), "data": res.data,
           "loss": {"per_step": res.losses, "floor": res.loss_floor},
           "throughput": {"tokens_per_s": res.tokens_per_s, "step_times_s": res.step_times,
                          # rank 0's device's time per step (a GPU), what tokens_per_s is the median of
                          "device_step_times_s": res.device_step_times,
                          # rank 0's host waiting for its device per step (torch backend on CUDA)
                          "host_blocked_s": res.values[0].get("host_blocked"), "wall_s": res.wall_s}}
    out["memory"] = []
    for r, v in enumerate(res.values):
        m = dict(v.get("memory") or {})
        for key in ("cuda_peak_allocated", "cuda_peak_reserved"):
            if key in v:
                m[key] = v[key]
        out["memory"].append({"rank": r, **m})
    out["communication"] = communication(res.ledger, steps)
    out["moe"] = [{str(k): v for k, v in st.items()} for st in res.moe_steps()] if run.model.n_experts else None
    out["loss_scaling"] = {"scale": res.values[0].get("loss_scale"),
                           "overflow_steps": res.values[0].get("overflow_steps", [])} if run.dtype == "float16" else None
    out["faults"] = {"injected": [str(f) for f in run.faults], "on_nan": run.on_nan,
                     "skipped_steps": res.values[0].get("skipped_steps", []),
                     "restarts": [{"fault": r.fault, "detected": r.detected, "failed_step": r.failed_step,
                                   "resumed_from": r.resumed_from, "steps_recomputed": r.steps_recomputed,
                                   "wall_lost_s": r.wall_lost_s, "sim_lost_s": r.sim_lost_s, "layout": r.layout}
                                  for r in res.restarts]}
    out["simulated"] = None
    if run.hardware:
        per_rank = []
        for r, v in enumerate(res.values):
            ordered = sorted(v["sim_steps"], key=lambda b: b["time"])
            b = ordered[len(ordered) // 2]
            per_rank.append({"rank": r, "step_s": b["time"], "compute_s": b["compute"], "host_s": b["host"],
                             "issuing_s": b["issuing"], "exposed_comm_s": b["exposed_comm"], "idle_s": b["idle"], "bubble_s": b["bubble"]})
        slowest = max(x["step_s"] for x in per_rank)
        out["simulated"] = {"hardware": run.hardware, "per_rank": per_rank,
                            "tokens_per_s": run.tokens_per_step / slowest if slowest else None}
    return out


def _finite(x):
    """JSON has no infinity: an error with no tolerance at all is written as null with ok false."""
    return None if x is None or x == float("inf") else x


def check_json(rep) -> dict:
    out = {"schema": f"playground.check/{CHECK_SCHEMA_VERSION}", **_run_json(rep.run), "passed": rep.passed,
           "tolerance": rep.tolerance, "ratio": _finite(rep.ratio), "problems": rep.problems,
           "routing_ties": {"groups": rep.ties, "assignments": rep.tied},
           "errors": [{"quantity": r.what, "tensor": r.name, "step": r.step, "max_abs": r.max_abs,
                       "max_rel": r.max_rel, "ratio": _finite(r.ratio), "ok": r.ok} for r in rep.rows]}
    if rep.result is not None:
        out["loss"] = {"per_step": rep.result.losses}
        out["communication"] = communication(rep.result.ledger, len(rep.result.losses))
    return out


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=float)
