"""The MoE layer's CUDA graphs (model/cuda_graphs.py) on a GPU, against the same layers run
as their compiled region, in one process:

    python benchmarks/moe_graphs_gpu.py [--layers 3] [--steps 4] [--microbatches 2] [--json F]

For each preset (1b-moe: top-2 of 8 with a capacity; 1b-dsmoe: top-4 of 16, a shared
expert, the sigmoid router, the balancing bias, dropless), a stack of `--layers` MoE layers
with residual adds, each layer's weights the same in both runs, trains `--steps` steps of
`--microbatches` accumulated microbatches under bf16 autocast (the weights updated in place
after each step, and the bias from the step's load): once as the compiled region, once
graphed (captured at the second call), and as the compiled region again (the control:
whether the region itself gives the same bits twice). Printed: whether every loss, weight gradient,
routing count and bias is bitwise the same, the largest relative difference of each, and
the wall time of one microbatch's forward and backward of the stack, host included (the
median of the last steps'), and how many kernels the CUDA profiler saw in it.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks._common import print_table, write_json  # noqa: E402
from model import preset  # noqa: E402
from model.cuda_graphs import CudaGraphs  # noqa: E402
from model.moe import MoE, MoEStats  # noqa: E402


def stack(cfg, layers: int, graphed: bool):
    torch.manual_seed(0)
    out = []
    for i in range(layers):
        layer = MoE(cfg).cuda()
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.02)
        layer.index = i
        out.append(layer)
    if graphed:
        graphs = CudaGraphs()
        for layer in out:
            layer.use_cuda_graphs(graphs)
    return out


def microbatch(moe, cfg, gen):
    """One microbatch of micro-batch 4 through the stack (residual adds, bf16 autocast), its
    backward done and waited for: its loss."""
    x = torch.randn(4, cfg.seq_len, cfg.d_model, device="cuda", generator=gen, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x
        for m in moe:
            h = h + m(h)
        loss = h.float().pow(2).mean()
    loss.backward()
    torch.cuda.synchronize()
    return loss


def train(cfg, layers: int, steps: int, microbatches: int, graphed: bool) -> dict:
    moe = stack(cfg, layers, graphed)
    params = [p for m in moe for p in m.parameters()]
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses, grads, counts, biases, times = [], [], [], [], []
    for step in range(steps):
        for m in moe:
            m.aux_scale = 1.0 / microbatches
        for mb in range(microbatches):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = microbatch(moe, cfg, gen)
            times.append(time.perf_counter() - t0)
            losses.append(loss.detach().clone())
        grads.append([p.grad.detach().clone() for p in params])
        with torch.no_grad():
            for p in params:
                p.sub_(1e-3 * p.grad)
                p.grad = None
        for m in moe:
            m.update_bias()
            s = m.stats.resolved()
            counts.append((s.aux, s.z, tuple(s.routed or ()), s.dropped))
            biases.append(None if m.expert_bias is None else m.expert_bias.detach().clone())
            m.stats = MoEStats()
    kernels = None
    if graphed:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            microbatch(moe, cfg, gen)
        kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return {"losses": losses, "grads": grads, "counts": counts, "biases": biases,
            "time": statistics.median(times[-(microbatches * 2):]), "kernels": kernels,
            "off": [m.graph.off for m in moe] if graphed else None}


def rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows, out = [], {}
    for name in ("1b-moe", "1b-dsmoe"):
        cfg = preset(name)
        plain = train(cfg, a.layers, a.steps, a.microbatches, False)
        graphed = train(cfg, a.layers, a.steps, a.microbatches, True)
        again = train(cfg, a.layers, a.steps, a.microbatches, False)  # (the control: is the region deterministic?)
        control = all(torch.equal(x, y) for x, y in zip(plain["losses"], again["losses"])) and all(
            torch.equal(x, y) for s, t in zip(plain["grads"], again["grads"]) for x, y in zip(s, t))
        same_loss = all(torch.equal(x, y) for x, y in zip(plain["losses"], graphed["losses"]))
        same_grads = all(torch.equal(x, y) for s, t in zip(plain["grads"], graphed["grads"]) for x, y in zip(s, t))
        worst_grad = max(rel(y, x) for s, t in zip(plain["grads"], graphed["grads"]) for x, y in zip(s, t))
        worst_loss = max(rel(y, x) for x, y in zip(plain["losses"], graphed["losses"]))
        same_counts = plain["counts"] == graphed["counts"]
        same_bias = all((x is None and y is None) or torch.equal(x, y)
                        for x, y in zip(plain["biases"], graphed["biases"]))
        rows.append([name, control, same_loss, f"{worst_loss:.1e}", same_grads, f"{worst_grad:.1e}", same_counts, same_bias,
                     f"{plain['time'] * 1e3:.2f}", f"{graphed['time'] * 1e3:.2f}", graphed["kernels"],
                     graphed["off"]])
        out[name] = {"plain_twice_bitwise": control, "bitwise_losses": same_loss, "worst_loss_rel": worst_loss, "bitwise_grads": same_grads,
                     "worst_grad_rel": worst_grad, "same_counts": same_counts, "same_bias": same_bias,
                     "plain_ms": plain["time"] * 1e3, "graphed_ms": graphed["time"] * 1e3,
                     "graphed_kernels": graphed["kernels"], "off": graphed["off"],
                     "config": dataclasses.asdict(cfg)}
    print_table(f"{a.layers} MoE layers, {a.steps} steps of {a.microbatches} microbatches (micro-batch 4), bf16 "
                "autocast: graphed against the compiled region",
                ["preset", "plain twice bitwise", "losses bitwise", "worst", "grads bitwise", "worst", "counts same", "bias same",
                 "plain ms/mb", "graphed ms/mb", "kernels/mb (graphed)", "sites off"], rows)
    if a.json:
        write_json(a.json, {"layers": a.layers, "steps": a.steps, "microbatches": a.microbatches, "results": out})


if __name__ == "__main__":
    main()
