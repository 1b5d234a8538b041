"""Benchmark: Megatron tensor parallelism with and without sequence parallelism on 350m
shapes (d_model 1024, 16 heads, seq 1024, vocab 50304, 24 layers) in bf16, on meta
tensors (shapes only: every collective is counted and timed, every op's FLOPs and bytes
are timed, every saved tensor is measured; nothing is computed). One microbatch of one
sequence, forward and backward, for tp = 1, 2, 4, 8.

Per rank: bytes sent by tensor parallelism per step (from the ledger), the simulated
forward+backward on h100-datasheet, the peak activation memory of the whole model, and the
activations of one block (the difference between 4 and 2 layers) beside Korthikanti et
al. 2022's per-layer formulas (bytes, 16-bit activations) without their attention-score
term, as a flash kernel (and their selective recomputation) keeps no scores: no
parallelism 34·sbh; TP sbh(10 + 24/t); TP + SP 34·sbh/t.

The formulas describe GPT-3's block (LayerNorm, GELU MLP of 4h, dropout masks); this block
has RMSNorm (normalised in fp32), a SwiGLU MLP of d_ff = 2816, rotary embeddings, no
dropout, and keeps the all-gathered input of its column-parallel layers under SP
(Megatron keeps the shard and gathers again in backward, trading 4sbh(1 - 1/t) bytes per
layer for one more all-gather): the table shows where they part. Prints a table and
writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from collectives import launch  # noqa: E402
from simulator import MemoryTracker, SimulatedTime  # noqa: E402
from model import GPT, preset  # noqa: E402
from playground.report import human_bytes  # noqa: E402
from tensor_parallel import parallelize_tensor  # noqa: E402


def rank_program(world, sp, n_layers, batch):
    cfg = preset("350m", n_layers=n_layers)
    model = GPT(cfg, dtype=torch.bfloat16, device="meta")
    if world.size > 1:
        model = parallelize_tensor(model, world, sp)
    memory = MemoryTracker()
    tokens = torch.empty(batch, cfg.seq_len, dtype=torch.long, device="meta")
    t0 = world.timing.clock.now
    with memory.track_activations(exclude=list(model.parameters())):
        loss = model(tokens, tokens)
        loss.backward()
    return {"peak_activations": memory.peak_activations, "step_s": world.timing.clock.now - t0}


def korthikanti(s, b, h, a, t, sp):
    """Bytes per layer, without the 5as/h (or 5as/(ht)) of the attention scores, softmax
    and dropout mask: a flash kernel keeps none of them (Korthikanti et al.'s selective
    recomputation of attention gives the same count)."""
    if t == 1:
        return s * b * h * 34
    return s * b * h * (34 / t if sp else 10 + 24 / t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", default=default_json("tensor_parallel"))
    args = ap.parse_args()
    cfg = preset("350m")
    s, b, h, a = cfg.seq_len, args.batch, cfg.d_model, cfg.n_heads
    sbh = s * b * h
    rows, out = [], []
    for tp in (1, 2, 4, 8):
        for sp in ((False, True) if tp > 1 else (False,)):
            res = launch(rank_program, tp, args=(sp, cfg.n_layers, b), time_model=SimulatedTime("h100-datasheet"))
            v = res.values[0]
            tp_calls = [e for e in res.ledger.for_rank(0) if e.label.startswith("tp.")]
            sent = sum(e.bytes_sent for e in tp_calls)
            algorithms = sorted({f"{e.op}:{e.algorithm}" for e in tp_calls if e.label.startswith(("tp.attn", "tp.mlp"))})
            small = [launch(rank_program, tp, args=(sp, n, b), time_model=SimulatedTime("h100-datasheet")).values[0][
                "peak_activations"] for n in (2, 4)]
            per_layer = (small[1] - small[0]) / 2
            formula = korthikanti(s, b, h, a, tp, sp)
            rows.append([tp, "yes" if sp else "no", human_bytes(sent), ", ".join(algorithms) or "-",
                         f"{v['step_s'] * 1e3:.2f} ms",
                         human_bytes(v["peak_activations"]), f"{per_layer / sbh:.1f} sbh", f"{formula / sbh:.1f} sbh",
                         f"{per_layer / formula:.2f}"])
            out.append({"tp": tp, "sp": sp, "tp_bytes_sent_per_step": sent, "simulated_step_s": v["step_s"],
                        "peak_activations": v["peak_activations"], "activations_per_layer": per_layer,
                        "korthikanti_per_layer": formula, "block_algorithms": algorithms})
    print_table(f"tensor parallelism on 350m shapes (s={s}, b={b}, h={h}, a={a}, {cfg.n_layers} layers, bf16, "
                f"meta tensors), per rank, one microbatch forward + backward",
                ["tp", "sp", "TP bytes sent", "block collectives (cost model's choice)", "step on h100-datasheet", "activations (peak, model)",
                 "activations / layer", "Korthikanti / layer", "measured / formula"], rows)
    print("TP bytes: what the algorithm the cost model chose sends (recursive doubling for all-reduces where its "
          "fewer latencies win; with ring, SP moves the same volume as TP: tests/test_tensor_parallel.py)")
    print("sbh = seq × batch × hidden elements; formulas count bytes of 16-bit activations (see the docstring "
          "for how this block differs from GPT-3's)")
    write_json(args.json, {"config": cfg.to_dict(), "batch": b, "results": out})


if __name__ == "__main__":
    main()
