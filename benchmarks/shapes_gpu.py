"""Benchmark (one GPU): the kernel efficiencies a hardware profile needs, by shape, for
`playground plan` (simulator/hardware.py, "measured").

1. bf16 matmuls at the shapes of training: (tokens m) × (k) → (n) for the QKV, output,
   MLP-up and MLP-down projections of hidden sizes 1024-16384 split by tensor parallelism
   1-8, at 2048-16384 tokens; FLOP/s and the fraction of the dense bf16 peak.
2. Fused attention (scaled_dot_product_attention, causal, forward + backward) at head
   dimensions 64 and 128 and sequences 1024-16384: FLOP/s with the causal half counted
   (the simulator's count).
3. Memory-bound kernels: a copy, an add, RMSNorm and AdamW's fused step on 256 MiB-1 GiB
   tensors: bytes read and written per second.
4. Clocks under the power limit: an 8192³ bf16 matmul back to back for 15 s, FLOP/s per
   second of it and the SM clock nvidia-smi reports.

Medians of CUDA-event timings after warm-ups. Writes JSON (--json).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def timed(fn, reps: int = 10, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def matmuls(peak: float) -> list:
    out = []
    seen = set()
    for h in (1024, 2048, 2304, 3072, 4096, 5120, 6144, 8192, 12288, 16384):
        f = 4 * h
        for tp in (1, 2, 4, 8):
            for m in (2048, 8192, 16384):
                for name, k, n in (("qkv", h, 3 * h // tp), ("out", h // tp, h), ("up", h, f // tp), ("down", f // tp, h)):
                    if (m, k, n) in seen:
                        continue
                    seen.add((m, k, n))
                    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                    s = timed(lambda: a @ b)
                    flops = 2 * m * k * n
                    out.append({"h": h, "tp": tp, "m": m, "k": k, "n": n, "op": name, "seconds": s,
                                "tflops": flops / s / 1e12, "fraction": flops / s / peak})
    return out


def attention(peak: float) -> list:
    out = []
    for hd in (64, 128):
        for s in (1024, 2048, 4096, 8192, 16384):
            heads = 2048 // hd * 2  # d_model 4096 at hd 128, 2048 at 64... (the head count does not change the rate)
            b = max(1, 16384 // s)
            q, k, v = (torch.randn(b, heads, s, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            g = torch.randn(b, heads, s, hd, device="cuda", dtype=torch.bfloat16)

            def fwd():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def fwd_bwd():
                o = fwd()
                o.backward(g)
            tf, tfb = timed(fwd), timed(fwd_bwd)
            full = 4 * b * heads * s * s * hd  # QK^T and AV of the full square, forward
            causal = full * (s + 1) / (2 * s)
            out.append({"head_dim": hd, "seq": s, "batch": b, "heads": heads, "forward_s": tf, "fwd_bwd_s": tfb,
                        "forward_fraction": causal / tf / peak, "fwd_bwd_fraction": 3.5 * causal / tfb / peak,
                        "fwd_bwd_fraction_3x": 3 * causal / tfb / peak})
    return out


def memory_bound(bandwidth: float) -> list:
    out = []
    n = 256 * 2**20  # elements
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    rows = [("copy bf16", lambda: x.clone(), 4 * n), ("add bf16", lambda: x + y, 6 * n)]
    xs = x.view(-1, 4096)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    rows.append(("rms_norm bf16 (4096)", lambda: F.rms_norm(xs, (4096,), w), 4 * n))
    p = [torch.randn(64 * 2**20, device="cuda") for _ in range(4)]
    gr = [torch.randn_like(t) for t in p]
    m1 = [torch.zeros_like(t) for t in p]
    m2 = [torch.zeros_like(t) for t in p]
    st = [torch.tensor(1.0, device="cuda") for _ in p]
    numel = sum(t.numel() for t in p)

    def adam():
        torch._fused_adamw_(p, gr, m1, m2, [], st, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8,
                            amsgrad=False, maximize=False)
    rows.append(("fused AdamW fp32", adam, numel * 4 * 7))  # reads p, g, m, v; writes p, m, v
    for name, fn, nbytes in rows:
        s = timed(fn)
        out.append({"kernel": name, "bytes": nbytes, "seconds": s, "bytes_per_s": nbytes / s,
                    "fraction": nbytes / s / bandwidth})
    return out


def sustained(peak: float, seconds: float = 15.0) -> list:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out, t_end = [], time.time() + seconds
    while time.time() < t_end:
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        for _ in range(200):
            a @ b
        ev1.record()
        torch.cuda.synchronize()
        s = ev0.elapsed_time(ev1) / 1e3
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout.strip()
        out.append({"t": seconds - (t_end - time.time()), "tflops": 200 * 2 * 8192**3 / s / 1e12,
                    "fraction": 200 * 2 * 8192**3 / s / peak, "smi": q})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s of the datasheet")
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s of the datasheet")
    ap.add_argument("--json", default="shapes_gpu.json")
    a = ap.parse_args()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "smi": subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm,power.limit", "--format=csv"],
                                  capture_output=True, text=True).stdout}
    print(info, flush=True)
    res = {"info": info, "sustained": sustained(a.peak)}
    for r in res["sustained"][::3]:
        print(f"sustained {r['t']:5.1f} s: {r['tflops']:.0f} TFLOP/s ({r['fraction']:.3f}) {r['smi']}", flush=True)
    res["memory_bound"] = memory_bound(a.bandwidth)
    for r in res["memory_bound"]:
        print(f"{r['kernel']:24s} {r['bytes_per_s'] / 1e12:.2f} TB/s ({r['fraction']:.3f})", flush=True)
    res["attention"] = attention(a.peak)
    for r in res["attention"]:
        print(f"attention hd {r['head_dim']} s {r['seq']}: forward {r['forward_fraction']:.3f}, forward+backward "
              f"{r['fwd_bwd_fraction']:.3f} (3x: {r['fwd_bwd_fraction_3x']:.3f})", flush=True)
    res["matmuls"] = matmuls(a.peak)
    for r in res["matmuls"]:
        print(f"mm h {r['h']:5d} tp {r['tp']} {r['op']:4s} {r['m']:5d}x{r['k']:5d}x{r['n']:5d}: {r['tflops']:6.0f} "
              f"TFLOP/s ({r['fraction']:.3f})", flush=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
