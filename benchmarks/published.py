"""Benchmark: published results reproduced by `playground plan`, printed beside the papers'.

1. ZeRO (Rajbhandari et al. 2019, Figure 1 and section 5.3): model-state memory per device
   of a 7.5B-parameter model on 64 data-parallel devices with mixed-precision Adam (K = 12),
   for the baseline and stages 1-3: 120, 31.4, 16.6 and 1.9 GB. Planned here: the 7.5B
   shape of Narayanan et al. below (SwiGLU with d_ff = 8h/3, rounded to 64, so that the MLP
   holds the 8h² parameters of their GeLU MLP: Ψ = 7.65B), dp 64, bf16 compute copies with
   fp32 master weights and moments, one micro-batch; printed: the parameters, gradients and
   optimizer states of one rank after the step (the gradients as the step's backward made
   them: stages 2-3 free theirs at the step), and the paper's formula with this Ψ. Stage 3
   here keeps no bf16 partition of the parameters (each all-gather casts the fp32 master
   shard, as FSDP2 does): 14Ψ/N against the paper's 16Ψ/N, 12.5% less by design.

2. The published runs of benchmarks/published_runs.py (each cited there, with what its
   source leaves unstated and what is chosen for it): the planned tokens per second per
   GPU against the published, and the planned memory against the published where given.
   Where a source states an interconnect other than the profile's (a DGX's), the run's
   `links` replace the profile's link fields for it (BLOOM's Jean Zay), the GPU's own kept.
   Each layout is planned through the search's estimate (playground/search.py: shallow
   plans extrapolated in blocks, microbatches and pipeline depth; equal to full plans to
   0.1% on the tiny preset), so a 16,384-GPU run plans in seconds. The error is
   planned/published - 1: positive, the plan is optimistic. `--plot FILE` draws planned
   against published.

3. By sequence (`mpt_by_sequence`): MPT-7b on 8 A100s and on 8 H100s at each sequence length
   of the same llm-foundry tables, 1,024 to 65,536 tokens, planned the same way and printed
   apart (not rows of the suite): the error against the share of the step attention takes.
   And BLOOM's cluster on one node (`bloom_one_node`: six of its layers at TP 8, measured
   while its layout was chosen), against the 176B run's error.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402
from benchmarks.published_runs import bloom_one_node, gelu_gpt, mpt_by_sequence, suite  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402
from playground.fits import DEFAULT_HEADROOM, usable  # noqa: E402
from playground.search import estimate  # noqa: E402
from simulator import load_hardware  # noqa: E402

# ZeRO, Figure 1: GB per device for Ψ = 7.5B, Nd = 64, K = 12
ZERO = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


def zero_rows() -> list:
    cfg, nd, k = gelu_gpt(51200, 4096, 32, 36, 2048), 64, 12
    psi = cfg.n_params()
    formula = {0: (2 + 2 + k) * psi, 1: 4 * psi + k * psi / nd, 2: 2 * psi + (2 + k) * psi / nd, 3: (2 + 2 + k) * psi / nd}
    rows = []
    for stage in range(4):
        p = plan(RunConfig(model=cfg, layout=Layout(dp=nd, zero=stage, micro_batch_size=1), dtype="bfloat16",
                           hardware="a100-80gb", progress=False))
        m = p.values[0]["memory"]
        states = m["parameters"] + m["gradients"] + m["optimizer"]
        rows.append({"stage": stage, "paper_gb": ZERO[stage], "formula_gb": formula[stage] / 1e9,
                     "planned_gb": states / 1e9, "error": states / 1e9 / ZERO[stage] - 1, "psi": psi})
    return rows


def with_links(name: str, links: dict, folder: str) -> str:
    """Profile `name` with the interconnect fields `links` (a source's stated cluster), as a
    profile file in `folder` (a plan takes a profile by name or file); `name` without links."""
    if not links:
        return name
    hw = load_hardware(name)
    hw = replace(hw, name=f"{hw.name}, the source's links", **links)
    path = os.path.join(folder, "profile.json")
    with open(path, "w") as f:
        json.dump(hw.to_dict(), f)
    return path


def plan_published(r, hardware: str | None = None) -> dict:
    """Plan the published run `r` (on `hardware`, else its own profile, with the interconnect
    its source states where that differs: `links`) and hold it to the source."""
    with tempfile.TemporaryDirectory() as folder:
        return _plan_published(r, with_links(hardware or r.hardware, r.links, folder))


def _plan_published(r, hardware: str) -> dict:
    run = RunConfig(model=r.model, layout=r.layout, dtype="bfloat16", hardware=hardware, progress=False, **r.run)
    t0 = time.perf_counter()
    e = estimate(run)
    planned = run.tokens_per_step / e.step_s / r.gpus
    out = {"source": r.source, "cite": r.cite, "name": r.name, "hardware": load_hardware(run.hardware).name,
           "links": r.links, "gpus": r.gpus,
           "layout": r.layout.describe(), "micro_batch": r.layout.micro_batch_size, "sequence": r.model.seq_len,
           "published": r.published,
           "chosen": r.chosen, "published_tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
           "planned_tokens_per_s_per_gpu": planned, "error": planned / r.tokens_per_s_per_gpu - 1,
           "step_s": e.step_s, "planned_peak_gb": e.peak / 1e9, "plans": e.plans,
           "fits": e.peak <= usable(load_hardware(run.hardware), DEFAULT_HEADROOM),
           "plan_wall_s": time.perf_counter() - t0}
    if r.memory_gb is not None:
        out.update(published_memory_gb=r.memory_gb, memory_what=r.memory_what,
                   memory_error=e.peak / 1e9 / r.memory_gb - 1)
    return out


def plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    for source in dict.fromkeys(r["source"] for r in rows):
        xs = [r["published_tokens_per_s_per_gpu"] for r in rows if r["source"] == source]
        ys = [r["planned_tokens_per_s_per_gpu"] for r in rows if r["source"] == source]
        ax.scatter(xs, ys, label=source, s=24)
    lo = min(min(r["published_tokens_per_s_per_gpu"], r["planned_tokens_per_s_per_gpu"]) for r in rows) / 1.3
    hi = max(max(r["published_tokens_per_s_per_gpu"], r["planned_tokens_per_s_per_gpu"]) for r in rows) * 1.3
    for f, style in ((1.0, "-"), (1.15, ":"), (1 / 1.15, ":")):
        ax.plot([lo, hi], [lo * f, hi * f], "k" + style, lw=0.8)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="published tokens/s per GPU",
           ylabel="planned tokens/s per GPU", title="playground plan against published runs (dotted: ±15%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="only the runs whose source or name contains this")
    ap.add_argument("--hardware", default=None, help="plan every run on this profile instead of its own")
    ap.add_argument("--plot", default=None, help="a PNG of planned against published tokens/s per GPU")
    ap.add_argument("--no-zero", action="store_true", help="leave out the ZeRO memory table")
    ap.add_argument("--no-sequence", action="store_true",
                    help="leave out MPT-7b by sequence length and BLOOM's cluster on one node")
    ap.add_argument("--json", default=default_json("published"))
    a = ap.parse_args()
    zero = [] if a.no_zero else zero_rows()
    if zero:
        print_table(f"ZeRO (Rajbhandari et al. 2019, Fig. 1): model states per device, 64 devices, Ψ = 7.5B in the "
                    f"paper, {zero[0]['psi'] / 1e9:.2f}B here",
                    ["stage", "paper", "formula with this Ψ", "planned", "planned/paper - 1"],
                    [[r["stage"], f"{r['paper_gb']:.1f} GB", f"{r['formula_gb']:.1f} GB", f"{r['planned_gb']:.2f} GB",
                      f"{r['error']:+.1%}"] for r in zero])
    runs = [r for r in suite() if a.only is None or a.only.lower() in (r.source + " " + r.name).lower()]
    rows = []
    for r in runs:
        rows.append(plan_published(r, a.hardware))
        x = rows[-1]
        print(f"  {x['source']}, {x['name']}: planned {x['planned_tokens_per_s_per_gpu']:,.0f} against "
              f"{x['published_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU ({x['error']:+.1%}; "
              f"{x['plan_wall_s']:.0f} s)", flush=True)
    errors = [abs(r["error"]) for r in rows]
    print_table("Published runs: tokens/s per GPU, planned against published (planned/published - 1; positive: "
                "the plan is optimistic)",
                ["source", "run", "GPU", "GPUs", "layout", "published", "tokens/s/GPU", "planned", "error",
                 "planned peak", "memory published / planned"],
                [[r["source"], r["name"], r["hardware"], f"{r['gpus']:,}", r["layout"].split(" (world")[0]
                  + f", mbs {r['micro_batch']}", r["published"], f"{r['published_tokens_per_s_per_gpu']:,.0f}",
                  f"{r['planned_tokens_per_s_per_gpu']:,.0f}", f"{r['error']:+.1%}",
                  f"{r['planned_peak_gb']:.0f} GB" + ("" if r["fits"] else " (does not fit)"),
                  f"{r['published_memory_gb']:.0f} / {r['planned_peak_gb']:.1f} GB ({r['memory_error']:+.1%})"
                  if "published_memory_gb" in r else "-"] for r in rows])
    summary = {"runs": len(rows), "sources": len({r["source"] for r in rows}),
               "within_15": sum(e <= 0.15 for e in errors), "median_abs_error": median(errors) if errors else None,
               "max_abs_error": max(errors) if errors else None}
    if errors:
        print(f"\n{summary['within_15']} of {len(rows)} runs within 15%; median absolute error "
              f"{summary['median_abs_error']:.1%}, largest {summary['max_abs_error']:.1%}")
    by_sequence = [] if a.no_sequence or a.only else [plan_published(r, a.hardware) for r in mpt_by_sequence()]
    if by_sequence:
        print_table("MPT-7b on 8 GPUs by sequence length (llm-foundry's tables; not rows of the suite): attention's "
                    "share of the step grows with the sequence",
                    ["GPU", "sequence", "micro-batch", "recomputation", "tokens/s/GPU", "planned", "error"],
                    [[r["hardware"], f"{r['sequence']:,}", r["micro_batch"],
                      "full" if "full activation" in r["layout"] else "none",
                      f"{r['published_tokens_per_s_per_gpu']:,.0f}", f"{r['planned_tokens_per_s_per_gpu']:,.0f}",
                      f"{r['error']:+.1%}"] for r in by_sequence])
    one_node = None if a.no_sequence or a.only else plan_published(bloom_one_node(), a.hardware)
    if one_node:
        print(f"\nBLOOM's cluster on one node ({one_node['published']}, not a row of the suite): planned "
              f"{one_node['planned_tokens_per_s_per_gpu']:,.0f} against "
              f"{one_node['published_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU ({one_node['error']:+.1%}), "
              f"{one_node['layout']}")
    if a.plot and rows:
        plot(rows, a.plot)
    write_json(a.json, {"benchmark": "published", "zero": zero, "runs": rows, "summary": summary,
                        "by_sequence": by_sequence, "bloom_one_node": one_node})


if __name__ == "__main__":
    main()
