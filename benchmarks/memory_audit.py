"""Benchmark: the memory tracker against the bytes the rank's program really holds.

Two tables (playground/memory_audit.py: a layout's ranks run as a plan runs them, on the meta
device, under simulator/live_bytes.py, which counts every storage an op makes while it
lives; compared over the second step's forward and backward, bf16 with compute copies):

1. Layouts of a small model (d_model 256, 4 layers, sequence 128, vocabulary 256: the
   activations outweigh the few small tensors the two count differently) across the
   strategies and schedules, and of its mixture-of-experts variants (4 experts top-2; 8
   fine-grained experts top-2 beside a shared one, dropless and at a capacity) alone and
   under expert parallelism, and a few layouts in float32, float64 and float16: per rank,
   the tracker's peak of transient bytes, the live bytes' peak, and what the tracker misses
   (live − tracked, as a share of tracked).
2. The layouts measured on H200s that a plan compares with (benchmarks/fidelity.py: the
   one-GPU rows of 1b and the two-GPU pipelines, TP, CP and DP rows of run13-run16, run27;
   1b-moe and 1b-dsmoe on one GPU, run68),
   per rank: the CUDA peak measured there less the peak planned now, and what the audit
   finds the tracker misses now. A plan also leaves out what the process holds beside the
   step's tensors (the CUDA context's allocations, cuBLAS's workspaces: 65-100 MiB in these
   runs, the same on every layout of a model), so a measured peak is that much over a plan
   whose tracker misses nothing. The pipeline rows were measured before their executor
   freed each sent output at its gradient's return and each sent gradient at a later
   receive, and before split backward's W freed its inputs: their measured peaks hold what
   the code then kept, which plans of the code now do not (the first stage of ZB-H1: about
   0.9 GiB at 1b).

Writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from benchmarks.fidelity import GPU, measured_run  # noqa: E402
from benchmarks.gpu_runs import train_jsons  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.memory_audit import audit  # noqa: E402
from playground.planning import plan  # noqa: E402

MODEL = preset("tiny", d_model=256, d_ff=768, n_layers=4, seq_len=128, vocab_size=256, n_heads=4)
LAYOUTS = [
    {}, {"dp": 2}, {"dp": 2, "zero": 1}, {"dp": 2, "zero": 2}, {"dp": 2, "zero": 3}, {"dp": 4, "zero": 3, "dp_replicate": 2},
    {"dp": 2, "tp": 2, "zero": 3, "sequence_parallel": True}, {"tp": 2}, {"tp": 2, "sequence_parallel": True},
    {"cp": 2}, {"cp": 2, "cp_impl": "ulysses"},
    {"pp": 2, "schedule": "gpipe", "microbatches": 4}, {"pp": 2, "schedule": "1f1b", "microbatches": 4},
    {"pp": 2, "schedule": "zb1", "microbatches": 4},
    {"pp": 2, "schedule": "interleaved", "microbatches": 4, "virtual_stages": 2},
    {"ac": "full"}, {"ac": "selective"}, {"pp": 2, "microbatches": 4, "ac": "full"},
    {"dp": 2, "tp": 2, "pp": 2, "microbatches": 4},
    {"tp": 2, "sequence_parallel": True, "pp": 2, "schedule": "zb1", "microbatches": 4},
]
# mixture of experts (the layer's compiled regions run as AOTAutograd's partition: model/compiled.py)
MOE = MODEL.with_(n_experts=4, top_k=2)
DSMOE = MODEL.with_(n_experts=8, top_k=2, expert_d_ff=384, n_shared_experts=1, router="sigmoid",
                    bias_update_rate=0.001, capacity_factor=0.0, aux_loss="sequence", aux_loss_coef=1e-4)
# other dtypes: float32 and float64 (each .grad made in backward; under DDP its bucket's view),
# float16 (loss-scaled compute copies)
DTYPE_LAYOUTS = [("float32", {}), ("float32", {"dp": 2}), ("float32", {"cp": 2}),
                 ("float64", {"dp": 2, "tp": 2, "pp": 2, "microbatches": 4}), ("float16", {"dp": 2, "zero": 1})]
MOE_LAYOUTS = [("moe", MOE, {}), ("moe", MOE, {"dp": 2, "ep": 2}),
               ("moe", MOE, {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True}),
               ("dsmoe", DSMOE, {}), ("dsmoe", DSMOE, {"dp": 2, "ep": 2}),
               ("dsmoe at capacity 1", DSMOE.with_(capacity_factor=1.0), {"dp": 2, "ep": 2})]
# (run folder, train JSON name): the GPU rows, the pipelines' measured before their executor changed
GPU_ROWS = [("run16_host", "1b_single"), ("run27_one_gpu", "1b-acfull-b4_single"), ("run16_host", "1b_tp2"),
            ("run16_host", "1b_tp2-sp"), ("run16_host", "1b_cp2"), ("run15_fidelity", "1b_dp2"),
            ("run15_fidelity", "1b_zero1"), ("run13_kernels", "1b_pp2-1f1b"), ("run13_kernels", "1b_pp2-zb1"),
            ("run14_side_by_side", "350m_pp2-1f1b"), ("run14_side_by_side", "350m_pp2-zb1"),
            ("run68_moe_ties", "1b-moe_1gpu_1"), ("run68_moe_ties", "1b-dsmoe_1gpu_1"),
            ("run27_one_gpu", "1b_zero3-w1"), ("run55_one_gpu_rows", "350m_zero3-w1")]
MEASURED_BEFORE = ("pp2",)  # rows whose code has changed since in what a step holds
MiB = 2 ** 20


def describe(kw: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in kw.items()) or "one rank"


def classes(values: list) -> list:
    """[(ranks, value)]: consecutive ranks with identical figures as one row."""
    out = []
    for r, v in enumerate(values):
        if out and out[-1][1] == v:
            out[-1][0].append(r)
        else:
            out.append(([r], v))
    return out


def ranks(rs: list) -> str:
    return str(rs[0]) if len(rs) == 1 else f"{rs[0]}-{rs[-1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=default_json("memory_audit"))
    a = ap.parse_args()

    layouts = []
    cases = [("dense", MODEL, kw, "bfloat16") for kw in LAYOUTS] + [(n, m, kw, "bfloat16") for n, m, kw in MOE_LAYOUTS] \
        + [(dtype, MODEL, kw, dtype) for dtype, kw in DTYPE_LAYOUTS]
    for name, model, kw, dtype in cases:
        run = RunConfig(model=model, layout=Layout(micro_batch_size=2, **kw), dtype=dtype, progress=False)
        layouts.append({"layout": describe(kw) if name == "dense" else f"{name}: {describe(kw)}", "dtype": dtype,
                        "ranks": audit(run)})
    rows = [[x["layout"], ranks(rs), f"{v['tracked']:,}", f"{v['live']:,}", f"{v['missed']:+,}",
             f"{v['missed'] / v['tracked']:+.2%}"] for x in layouts for rs, v in classes(x["ranks"])]
    worst = max(abs(v["missed"]) / v["tracked"] for x in layouts for v in x["ranks"])
    print_table(f"tracker against live bytes, bf16 unless named, d_model 256, 4 layers, micro-batch 2 x 128 tokens "
                f"(largest miss {worst:.2%} of the tracked peak)",
                ["layout", "ranks", "tracked peak (B)", "live peak (B)", "missed (B)", "of tracked"], rows)

    gpu = []
    for folder, name in GPU_ROWS:
        m = dict(train_jsons(os.path.join(GPU, folder)))[name]
        run = RunConfig(**{**measured_run(m).__dict__, "hardware": "h200"})
        planned = [v["memory"]["peak_total"] for v in plan(run).values]
        found = audit(run)
        measured = [r.get("cuda_peak_allocated") for r in m["memory"]]
        gpu.append({"run": name, "measured_in": folder, "measured_before_change": any(k in name for k in MEASURED_BEFORE),
                    "ranks": [{"measured_cuda_peak": measured[r], "planned_peak": planned[r],
                               "measured_minus_planned": measured[r] - planned[r], "audit_missed": found[r]["missed"]}
                              for r in range(len(planned))]})
    rows = [[g["run"] + (" (measured before)" if g["measured_before_change"] else ""), g["measured_in"], r,
             f"{x['measured_cuda_peak'] / MiB:,.0f}", f"{x['planned_peak'] / MiB:,.0f}",
             f"{x['measured_minus_planned'] / MiB:+,.1f}", f"{x['audit_missed'] / MiB:+,.1f}"]
            for g in gpu for r, x in enumerate(g["ranks"])]
    print_table("H200 runs (bf16 with compute copies): measured CUDA peak against the plan now, per rank, MiB",
                ["run", "measured in", "rank", "measured", "planned", "measured - planned", "audit: missed"], rows)
    write_json(a.json, {"benchmark": "memory_audit", "model": MODEL.__dict__, "layouts": layouts, "gpu_rows": gpu})


if __name__ == "__main__":
    main()
