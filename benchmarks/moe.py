"""Benchmark: mixture of experts with expert parallelism. Four tables:

1. Routing (small-moe: 8 experts, top-2, 4 blocks; 8 ranks, dp 8, ep 8, 4 sequences of 128
   tokens per rank, trained `--steps` steps): for capacity factor 1.0, 1.25, 2.0 and dropless,
   with the load-balancing loss (α = 0.01) and without (α = 0): the fraction of assignments
   dropped and the max/mean expert load, both over the last quarter of the steps and every
   MoE layer, and the final loss.
2. Balancing methods at equal steps (the same model, dp 8, ep 8, capacity factor 1.0):
   none; Switch's load-balancing loss over the microbatch (α = 0.01); the same loss per
   sequence (α = 0.01); the auxiliary-loss-free bias alone (γ = 0.001, Wang et al. 2024);
   and DeepSeek-V3's recipe (sigmoid router, bias γ = 0.001, sequence-wise loss α = 0.0001):
   dropped, max/mean load (median and worst over the last quarter of the steps and every MoE
   layer), the spread of the final biases, and the final loss, with and without the
   auxiliary and z losses (the language model's own, comparable across methods).
3. Expert parallelism (the same model, cf 1.0, α = 0.01, dp 8, ep 1, 2, 4, 8, simulated on
   h100-datasheet): bytes each rank sends per step by the token dispatch and combine (`moe.*`) and
   in all, the simulated step and its exposed communication, the model states per rank.
4. The GPU-sized presets (1b-moe: about 1B parameters, 8 experts, top-2; 1b-dsmoe: 16
   experts of half the width, top-4, one shared) on meta tensors
   (shapes only; routing assumed balanced on meta), 8 ranks, one microbatch of 4 × 2048
   tokens, forward and backward in bf16 with DDP over dp 8 at ep 1 and ep 8: bytes per rank,
   simulated step, exposed communication, model states and peak activations per rank.
Prints the tables and writes JSON.
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402
from collectives import Mesh, launch  # noqa: E402
from collectives.ledger import human_bytes  # noqa: E402
from model import GPT, preset  # noqa: E402
from playground import Layout, RunConfig, train  # noqa: E402
from playground.parallelize import parallelize  # noqa: E402
from simulator import MemoryTracker, SimulatedTime  # noqa: E402

HW = "h100-datasheet"


def _trained(cfg, steps: int) -> tuple:
    """(the run, its routing over the last quarter of the steps): small-moe's shape, dp 8 × ep 8."""
    res = train(RunConfig(model=cfg, layout=Layout(dp=8, ep=8, micro_batch_size=4), steps=steps, lr=3e-3,
                          progress=False))
    tail = res.moe_steps()[-max(1, steps // 4):]
    dropped = sum(st["dropped"] for s in tail for st in s.values()) / sum(st["assignments"] for s in tail
                                                                          for st in s.values())
    imbalance = [max(st["routed"]) / (sum(st["routed"]) / len(st["routed"])) for s in tail for st in s.values()]
    # the language-model loss alone: the reported loss less the layers' auxiliary and z losses
    lm = res.losses[-1] - sum(st["aux"] + st["z"] for st in res.moe_steps()[-1].values())
    return res, {"dropped": dropped, "max_over_mean": median(imbalance), "worst_max_over_mean": max(imbalance),
                 "final_loss": res.losses[-1], "final_lm_loss": lm, "loss_floor": res.loss_floor}


def routing(cf: float, aux: float, steps: int) -> dict:
    _, m = _trained(preset("small-moe", capacity_factor=cf, aux_loss_coef=aux), steps)
    return {"capacity_factor": cf, "aux_loss_coef": aux, **m}


BALANCING = {  # name: GPTConfig overrides of small-moe (capacity factor 1.0)
    "none": dict(aux_loss_coef=0.0),
    "Switch loss, batch (α 0.01)": dict(aux_loss_coef=0.01),
    "Switch loss, per sequence (α 0.01)": dict(aux_loss_coef=0.01, aux_loss="sequence"),
    "bias only (γ 0.001)": dict(aux_loss_coef=0.0, bias_update_rate=0.001),
    "DeepSeek-V3 (sigmoid, γ 0.001, seq α 1e-4)": dict(router="sigmoid", bias_update_rate=0.001,
                                                         aux_loss="sequence", aux_loss_coef=0.0001),
}


def balancing(name: str, steps: int) -> dict:
    res, m = _trained(preset("small-moe", **BALANCING[name]), steps)
    bias = [b for st in res.moe_steps()[-1].values() for b in st.get("bias") or []]
    return {"method": name, **BALANCING[name], **m, "bias_min": min(bias, default=None),
            "bias_max": max(bias, default=None)}


def parallel(ep: int) -> dict:
    cfg = preset("small-moe")
    res = train(RunConfig(model=cfg, layout=Layout(dp=8, ep=ep, micro_batch_size=4), steps=4, hardware=HW,
                          progress=False))
    steps = len(res.losses)
    per_rank = []
    for r in range(8):
        entries = [e for e in res.ledger.for_rank(r) if not e.label.endswith("broadcast")]
        sim = sorted(res.values[r]["sim_steps"], key=lambda b: b["time"])[len(res.values[r]["sim_steps"]) // 2]
        m = res.values[r]["memory"]
        per_rank.append({"moe_sent": sum(e.bytes_sent for e in entries if e.label.startswith("moe.")) / steps,
                         "sent": sum(e.bytes_sent for e in entries) / steps, "step_s": sim["time"],
                         "exposed_s": sim["exposed_comm"], "states": m["parameters"] + m["gradients"] + m["optimizer"]})
    worst = max(per_rank, key=lambda x: x["step_s"])
    return {"ep": ep, **worst}


def meta_rank(world, name, ep):
    cfg = preset(name)
    run = RunConfig(model=cfg, layout=Layout(dp=8, ep=ep, micro_batch_size=4), dtype="bfloat16", steps=1)
    mesh = Mesh(world, pp=1, dp=8, cp=1, tp=1)
    memory = world.instruments.memory = MemoryTracker()  # the rank's, which the strategies report to
    model = parallelize(GPT(cfg, dtype=torch.bfloat16, device="meta"), mesh, run, "meta")
    tokens = torch.empty(4, cfg.seq_len + 1, dtype=torch.long, device="meta")
    clock = world.timing.clock
    t0 = clock.breakdown()
    model.run_step([tokens], lambda: memory.track_activations(exclude=model.params))
    t1 = clock.breakdown()
    states = MemoryTracker.measure(model.state_tensors())
    return {"step_s": t1["time"] - t0["time"], "exposed_s": t1["exposed_comm"] - t0["exposed_comm"],
            "peak_activations": memory.peak_activations,
            # bf16 weights and gradients as measured; AdamW's fp32 master and moments (12 bytes per
            # parameter) are not made on meta until a step: added by count
            "states": states["parameters"] + states["gradients"] + 6 * states["parameters"]}


def gpu_sized(name: str, ep: int) -> dict:
    res = launch(meta_rank, 8, args=(name, ep), time_model=SimulatedTime(HW))
    v = res.values[0]
    entries = [e for e in res.ledger.for_rank(0) if not e.label.endswith("broadcast")]
    return {"model": name, "ep": ep, "moe_sent": sum(e.bytes_sent for e in entries if e.label.startswith("moe.")),
            "sent": sum(e.bytes_sent for e in entries), **v}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--json", default=default_json("moe"))
    args = ap.parse_args()
    rows, first = [], []
    for cf in (1.0, 1.25, 2.0, 0.0):
        for aux in (0.01, 0.0):
            m = routing(cf, aux, args.steps)
            first.append(m)
            rows.append(["dropless" if not cf else f"{cf:g}", f"{aux:g}", f"{100 * m['dropped']:.1f}%",
                         f"{m['max_over_mean']:.2f}", f"{m['final_loss']:.4f}"])
            print(" ".join(rows[-1]), flush=True)
    print_table(f"routing: small-moe (8 experts, top-2), dp 8 × ep 8, {args.steps} steps; over the last quarter of "
                f"the steps and every MoE layer", ["capacity factor", "aux loss α", "dropped", "max/mean load",
                                                   "final loss"], rows)
    balanced, rows = [], []
    for name in BALANCING:
        m = balancing(name, args.steps)
        balanced.append(m)
        rows.append([name, f"{100 * m['dropped']:.1f}%", f"{m['max_over_mean']:.2f}", f"{m['worst_max_over_mean']:.2f}",
                     f"{m['bias_min']:+.3f} .. {m['bias_max']:+.3f}" if m["bias_min"] is not None else "-",
                     f"{m['final_lm_loss']:.4f}", f"{m['final_loss']:.4f}"])
        print(" | ".join(rows[-1]), flush=True)
    print_table(f"balancing: small-moe (8 experts, top-2, capacity factor 1.0), dp 8 × ep 8, {args.steps} steps; "
                f"over the last quarter of the steps and every MoE layer", ["method", "dropped", "max/mean load",
                                                                           "worst max/mean", "final biases",
                                                                           "final LM loss", "final loss"], rows)
    second, rows = [], []
    for ep in (1, 2, 4, 8):
        m = parallel(ep)
        second.append(m)
        rows.append([ep, human_bytes(m["moe_sent"]), human_bytes(m["sent"]), f"{m['step_s'] * 1e3:.3f} ms",
                     f"{m['exposed_s'] * 1e3:.3f} ms", human_bytes(m["states"])])
    print_table(f"expert parallelism: small-moe, dp 8, 4 sequences of 128 tokens per rank, cf 1.0, simulated on {HW}; "
                "per rank per step, the slowest", ["ep", "moe.* sent", "all sent", "step", "exposed comm",
                                                   "model states"], rows)
    third, rows = [], []
    for name in ("1b-moe", "1b-dsmoe"):
        for ep in (1, 8):
            m = gpu_sized(name, ep)
            third.append(m)
            cfg = preset(name)
            rows.append([name, f"{cfg.n_params() / 1e9:.2f}B", f"{cfg.n_experts}×{cfg.expert_width}, top-{cfg.top_k}"
                         + (f" + {cfg.n_shared_experts} shared" if cfg.n_shared_experts else ""), ep,
                         human_bytes(m["moe_sent"]), human_bytes(m["sent"]), f"{m['step_s'] * 1e3:.1f} ms",
                         f"{m['exposed_s'] * 1e3:.1f} ms", human_bytes(m["states"]), human_bytes(m["peak_activations"])])
    print_table(f"the GPU-sized presets on meta tensors, dp 8, one microbatch of 4 × 2048 tokens, bf16, simulated on "
                f"{HW}; rank 0", ["model", "parameters", "experts", "ep", "moe.* sent", "all sent", "forward+backward",
                                  "exposed comm", "model states", "activations (peak)"], rows)
    write_json(args.json, {"routing": first, "balancing": balanced, "expert_parallel": second, "gpu_sized": third})


if __name__ == "__main__":
    main()
