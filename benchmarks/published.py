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

2. Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
   Using Megatron-LM"), Table 1: achieved TFLOP/s per A100 of GPT models trained with
   tensor (t) and pipeline (p) parallelism, data parallelism over the rest, vocabulary
   51,200, sequence 2048, mixed precision, full activation recomputation. Taken from the
   table: heads, hidden size, layers, t, p, GPUs and batch. Chosen here (the table does not
   give them): micro-batch 1, the 1F1B schedule, no sequence parallelism (it came a year
   later), the a100-80gb profile (Selene: 8 GPUs per node on NVLink, 8 HDR InfiniBand links
   per node); the MLP as in part 1. Their implementation, as the paper and Megatron-LM of
   that time have it: attention without FlashAttention (it came a year later), the scores
   written to memory and a fused scale-mask-softmax (section 4: `attention="unfused"`), and
   data parallelism that all-reduces the gradient buffer after the pipeline's
   forward-backward (Megatron-LM's local DDP in `train_step`: `--no-grad-overlap`), and
   dropout 0.1 on the attention probabilities (Megatron-LM's `--attention-dropout` default;
   `attention_dropout=0.1`; its hidden dropout is fused with the bias and residual add,
   which costs what the residual add here costs, and is not modelled); with flash attention
   and overlapped reductions the 1.7B row came out at +53.9%, +26.5% unfused, +24.7% with
   the reductions after the backward, +12.2% with the dropout. The planned TFLOP/s per GPU
   counts FLOPs as the paper does (its equation 3: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per iteration, the
   recomputation's forward included) over the planned step. The plan is not calibrated to
   A100 kernels: its roofline takes 80% of peak for matmuls.

Default rows: the 1.7B to 76.1B models (the larger ones plan for minutes to hours each:
their pipelines run hundreds of microbatches; `--all` adds them). Writes JSON.
"""
import argparse
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from model import GPTConfig  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402

SEQ, VOCAB = 2048, 51200
# Narayanan et al. 2021, Table 1: billions of parameters, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU
NARAYANAN = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# ZeRO, Figure 1: GB per device for Ψ = 7.5B, Nd = 64, K = 12
ZERO = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


def gpt(hidden: int, heads: int, layers: int, **kw) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, d_model=hidden, n_layers=layers, n_heads=heads, d_ff=8 * hidden // 3 // 64 * 64,
                     seq_len=SEQ, **kw)


def zero_rows() -> list:
    cfg, nd, k = gpt(4096, 32, 36), 64, 12
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


def narayanan_row(row) -> dict:
    billions, heads, h, l, t, p, n, batch, paper = row
    cfg = gpt(h, heads, l, attention="unfused", attention_dropout=0.1)
    dp = n // (t * p)
    layout = Layout(dp=dp, tp=t, pp=p, micro_batch_size=1, microbatches=batch // dp, ac="full")
    t0 = time.perf_counter()
    pl = plan(RunConfig(model=cfg, layout=layout, dtype="bfloat16", hardware="a100-80gb", progress=False,
                        grad_overlap=False))
    flops = 96 * batch * SEQ * l * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * l * h))
    planned = flops / pl.step_s / n / 1e12
    slowest = max(pl.values, key=lambda v: v["step"]["time"])["step"]
    return {"billions": billions, "params": cfg.n_params(), "t": t, "p": p, "gpus": n, "batch": batch,
            "paper_tflops": paper, "planned_tflops": planned, "error": planned / paper - 1, "step_s": pl.step_s,
            "split": slowest, "plan_wall_s": time.perf_counter() - t0,
            "peak_gib": pl.peak / 2**30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="also the 145.6B to 1T models (slow: hours)")
    ap.add_argument("--json", default=default_json("published"))
    a = ap.parse_args()
    zero = zero_rows()
    print_table(f"ZeRO (Rajbhandari et al. 2019, Fig. 1): model states per device, 64 devices, Ψ = 7.5B in the paper, "
                f"{zero[0]['psi'] / 1e9:.2f}B here",
                ["stage", "paper", "formula with this Ψ", "planned", "planned/paper - 1"],
                [[r["stage"], f"{r['paper_gb']:.1f} GB", f"{r['formula_gb']:.1f} GB", f"{r['planned_gb']:.2f} GB",
                  f"{r['error']:+.1%}"] for r in zero])
    rows = [narayanan_row(r) for r in (NARAYANAN if a.all else [r for r in NARAYANAN if r[0] < 100])]
    print_table("Narayanan et al. 2021, Table 1: TFLOP/s per A100 (their count, recomputation included), planned on "
                "a100-80gb with full activation checkpointing, micro-batch 1, 1F1B, unfused attention with dropout 0.1, "
                "gradients reduced after the backward",
                ["model", "t", "p", "GPUs", "batch", "paper", "planned", "planned/paper - 1", "planned step",
                 "compute / exposed comm / idle", "peak memory", "plan wall"],
                [[f"{r['billions']}B", r["t"], r["p"], r["gpus"], r["batch"], f"{r['paper_tflops']}",
                  f"{r['planned_tflops']:.1f}", f"{r['error']:+.1%}", f"{r['step_s']:.2f} s",
                  f"{r['split']['compute']:.2f} / {r['split']['exposed_comm']:.2f} / {r['split']['idle']:.2f} s",
                  f"{r['peak_gib']:.1f} GiB", f"{r['plan_wall_s']:.0f} s"] for r in rows])
    write_json(a.json, {"benchmark": "published", "zero": zero, "narayanan": rows})


if __name__ == "__main__":
    main()
