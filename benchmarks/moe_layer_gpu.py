"""Where a 1b-moe step's device time goes beside its dense model's, one part at a time, on a
GPU, in one process:

    python benchmarks/moe_layer_gpu.py [--iters 20] [--json F]

Each part runs its forward and backward (or its optimizer pass) `--iters` times after a
warm-up; printed: the median device time of one (CUDA events), and from one profiled
iteration the kernels by device time. Parts, at 1b-moe's shapes (micro-batch 4 of 2048
tokens, d_model 1024):

- `moe`: one MoE layer (model/moe.py) on a GPU, the compiled region `whole_layer`, its
  weights in bf16 (as `--bf16-copies` computes) under bf16 autocast;
- `moe_fp32`: the same with fp32 weights cast by autocast (the issue's command);
- `experts`: its three grouped GEMMs and SwiGLU alone (`grouped_swiglu`) on 2·T rows
  sorted expert-major, each expert 2·T/E of them;
- `dense`: the dense model's MLP (SwiGLU of d_ff 5472, the same active FLOPs) on T rows;
- `dense_rows`: a SwiGLU of the experts' width (2736) on 2·T rows (the experts' GEMM
  shapes as one dense GEMM each);
- `adamw_moe`, `adamw_dense`: the optimizer pass of ZeRO's stage 0 with bf16 compute
  copies (zero/zero.py `step`) over flat units of each model's parameter count: the bf16
  gradient cast to fp32, torch's fused AdamW, the fp32 masters copied into the bf16
  copies, the bf16 gradient zeroed; `adamw_moe_one_pass`: zero/master_adamw.py's step
  (one compiled pass a unit: the bf16 gradient read, the masters and moments updated, the
  copy written), then the gradient zeroed; and, for it and torch's fused AdamW, the worst
  error of the masters and moments against AdamW's float64 formula over 3 steps, each
  from the same state (relative to the larger of the value before and the step's change).
"""
import argparse
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks._common import print_table, write_json  # noqa: E402
from benchmarks.shapes_gpu import timed as event_timed  # noqa: E402
from model import preset  # noqa: E402
from model.gpt import SwiGLU  # noqa: E402
from model.moe import MoE, MoEStats, grouped_swiglu  # noqa: E402
from zero.master_adamw import adamw_formula, master_adamw  # noqa: E402
from zero.optimizer import adamw  # noqa: E402


def timed(fn, iters: int) -> tuple:
    """(median ms of fn() on the device, [(kernel, ms)] of one profiled call)."""
    ms = event_timed(fn, reps=iters) * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1e3
    return ms, sorted(kernels.items(), key=lambda kv: -kv[1])


def layer_part(module, x, grad, stats=None):
    def fn():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = module(x)
        y.backward(grad)
        if stats is not None:
            module.stats = MoEStats()
    return fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    c = preset("1b-moe")
    T, d, E = 4 * c.seq_len, c.d_model, c.n_experts
    parts, agreement = {}, {}

    def moe(dtype):
        m = MoE(c).cuda()
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02)
        m.to(dtype)
        x = torch.randn(4, c.seq_len, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return layer_part(m, x, torch.randn_like(x), stats=True)
    parts["moe"] = moe(torch.bfloat16)
    parts["moe_fp32"] = moe(torch.float32)

    w = [(torch.randn(E, f, i, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
         for f, i in ((c.expert_width, d), (c.expert_width, d), (d, c.expert_width))]
    rows = torch.randn(2 * T, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = torch.full((E,), 2 * T // E, device="cuda", dtype=torch.long)
    g_rows = torch.randn_like(rows)
    parts["experts"] = lambda: grouped_swiglu(rows, counts, *w).backward(g_rows)

    def dense(width, n):
        mlp = SwiGLU(c.with_(d_ff=width)).cuda().to(torch.bfloat16)
        x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return layer_part(mlp, x, torch.randn_like(x))
    parts["dense"] = dense(5472, T)
    parts["dense_rows"] = dense(c.expert_width, 2 * T)

    def units(n_params: int) -> tuple:
        """(sizes, fp32 masters, bf16 copies, bf16 gradients, AdamW) of flat units of 64 Mi
        elements (a 1b-moe block holds about 71M) holding n_params in all."""
        unit = 1 << 26
        sizes = [unit] * (n_params // unit) + ([n_params % unit] if n_params % unit else [])
        masters = [torch.zeros(s, device="cuda", dtype=torch.float32, requires_grad=True) for s in sizes]
        copies = [torch.zeros(s, device="cuda", dtype=torch.bfloat16) for s in sizes]
        grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in sizes]
        return sizes, masters, copies, grads, adamw(masters, lr=1e-4)

    def step(n_params: int):
        _, masters, copies, grads, opt = units(n_params)

        def fn():
            for p, g in zip(masters, grads):
                p.grad = g.to(torch.float32)
            opt.step()
            for p, b, g in zip(masters, copies, grads):
                p.grad = None
                b.copy_(p.detach())
                g.zero_()
        return fn

    def one_pass(n_params: int):
        """zero/master_adamw.py's step over the same units; and its worst error and torch's fused
        AdamW's against the float64 formula over 3 steps of one unit."""
        sizes, _, copies, grads, opt = units(n_params)

        def fn():
            master_adamw(opt, grads, copies)
            for g in grads:
                g.zero_()
        gen = torch.Generator(device="cuda").manual_seed(2)
        n = sizes[0]
        start = torch.randn(n, device="cuda", generator=gen) * 0.02
        ref, mine = start.clone().requires_grad_(), start.clone().requires_grad_()
        lr, wd, (b1, b2), eps = 3e-4, 0.1, (0.9, 0.95), 1e-8
        ref_opt, my_opt = (adamw([t], lr=lr, betas=(b1, b2), weight_decay=wd) for t in (ref, mine))
        copy = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        exact = [start.double(), torch.zeros(n, device="cuda", dtype=torch.float64),
                 torch.zeros(n, device="cuda", dtype=torch.float64)]
        worst = {"torch_fused": [0.0] * 3, "master_adamw": [0.0] * 3}
        for t in range(1, 4):  # each step from the state the float64 formula is given
            g = (torch.randn(n, device="cuda", generator=gen) * 10 ** (-6 * torch.rand(n, device="cuda", generator=gen))
                 ).to(torch.bfloat16)
            ref.grad = g.float()
            ref_opt.step()
            master_adamw(my_opt, [g], [copy])
            P, M, V = adamw_formula(*exact, g, t, lr, (b1, b2), wd, eps)  # (from master_adamw's state before it)
            for name, (p, opt) in (("torch_fused", (ref, ref_opt)), ("master_adamw", (mine, my_opt))):
                st = opt.state[p]
                for i, (got, want, prior) in enumerate(zip((p.detach(), st["exp_avg"], st["exp_avg_sq"]), (P, M, V),
                                                           exact)):
                    scale = torch.maximum(prior.abs(), (want - prior).abs()).clamp(min=1e-30)
                    worst[name][i] = max(worst[name][i], float(((got.double() - want) / scale).abs().max()))
            exact = [mine.detach().double(), my_opt.state[mine]["exp_avg"].double(),
                     my_opt.state[mine]["exp_avg_sq"].double()]
            ref.data.copy_(mine.detach())  # (both sides start each step from the same state)
            ref_opt.state[ref]["exp_avg"].copy_(my_opt.state[mine]["exp_avg"])
            ref_opt.state[ref]["exp_avg_sq"].copy_(my_opt.state[mine]["exp_avg_sq"])
        same = {"worst_relative_error_vs_float64 (param, exp_avg, exp_avg_sq)": worst,
                "copy_is_master_rounded": bool(torch.equal(copy, mine.detach().to(torch.bfloat16)))}
        print(f"AdamW over {n} elements, 3 steps, each from one state, against the float64 formula: {same}")
        agreement.update(same)
        return fn

    from model import GPT
    n_moe = sum(p.numel() for p in GPT(c, device="meta").parameters())
    n_dense = sum(p.numel() for p in GPT(c.with_(n_experts=0, d_ff=5472), device="meta").parameters())
    parts["adamw_moe"] = step(n_moe)
    parts["adamw_dense"] = step(n_dense)
    parts["adamw_moe_one_pass"] = one_pass(n_moe)

    rows_out, out = [], {}
    for name, fn in parts.items():
        ms, kernels = timed(fn, a.iters)
        out[name] = {"ms": ms, "kernels": [[k, t] for k, t in kernels[:25]]}
        rows_out.append([name, f"{ms:.3f}", f"{sum(t for _, t in kernels):.3f}", len(kernels)])
        print(f"\n== {name}: {ms:.3f} ms (median of {a.iters}); kernels of one profiled call:")
        for k, t in kernels[:14]:
            print(f"  {t:8.3f} ms  {k[:110]}")
    print_table(f"1b-moe's parts on {torch.cuda.get_device_name()} (T {T}, d {d}, E {E}, top-{c.top_k}; "
                f"params: MoE {n_moe / 1e9:.3f}B, dense {n_dense / 1e9:.3f}B)",
                ["part", "ms (events, median)", "ms (profiled kernels)", "kernel names"], rows_out)
    if a.json:
        write_json(a.json, {"T": T, "params": {"moe": n_moe, "dense": n_dense}, "parts": out,
                            "master_adamw_vs_fused": agreement})


if __name__ == "__main__":
    main()
