"""Benchmark (one GPU): the reference GPT's element-wise parts before and after they were
rewritten for eager speed, at the shapes of a preset (default 1b, micro-batch 4, bf16).

- RMSNorm: before, the LLaMA formula op by op (upcast, square, mean, rsqrt, scale, cast,
  weight); after, `model.gpt.rms_norm` (torch's `F.rms_norm`). Also lists the aten ops
  `F.rms_norm` dispatches on this device, forward and backward (one fused kernel each way
  where torch has one).
- RoPE and the attention around it: before, heads first (b, heads, s, head_dim), RoPE as
  a cat of two halves each built from two products, the kernel's output merged back with
  a copy; after, `model.gpt.apply_rope` in (b, s, heads) order (x·cos + roll(x)·sin) and
  the merge a view.
- One whole block, forward and backward, after.

Each part forward + backward: median device time (CUDA events) of 20 after 3 warm-ups, and
the CUDA kernels launched (torch profiler). Prints a table; writes JSON (--json).

    python benchmarks/kernels_gpu.py --model 1b --micro-batch-size 4 --json out.json
"""
import argparse
import json
import os
import statistics
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from model import preset  # noqa: E402
from model.gpt import Block, apply_rope, rms_norm, rope_tables  # noqa: E402


def norm_before(x, w, eps):
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_before(x, cos, sin):  # x (b, heads, s, head_dim); cos, sin (s, head_dim / 2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention_before(q, k, v, cos, sin):  # q, k, v as the projections give them: (b, s, heads, head_dim)
    b, s = q.shape[:2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    y = F.scaled_dot_product_attention(rope_before(q, cos, sin), rope_before(k, cos, sin), v, is_causal=True)
    return y.transpose(1, 2).reshape(b, s, -1)


def attention_after(q, k, v, cos, sin):
    b, s = q.shape[:2]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return y.transpose(1, 2).reshape(b, s, -1)


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def measure(fn, inputs) -> dict:
    """fn(*inputs) forward and backward: median ms over 20 runs, CUDA kernels per run."""
    def step():
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.grad = None
    for _ in range(3):
        step()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    return {"ms": statistics.median(times), "kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--json")
    a = ap.parse_args()
    c, dev, dt = preset(a.model), "cuda", torch.bfloat16
    b, s, d, hd = a.micro_batch_size, c.seq_len, c.d_model, c.head_dim
    torch.manual_seed(0)
    x = torch.randn(b, s, d, device=dev, dtype=dt, requires_grad=True)
    w = torch.ones(d, device=dev, dtype=dt, requires_grad=True)
    ops = {}
    for name in ("forward", "backward"):
        probe = OpNames()
        if name == "forward":
            with probe:
                y = rms_norm(x, w, c.norm_eps)
        else:
            with probe:
                y.backward(torch.ones_like(y))
        ops[name] = probe.names
    x.grad = w.grad = None
    qkv = [torch.randn(b, s, n, hd, device=dev, dtype=dt, requires_grad=True)
           for n in (c.n_heads, c.kv_heads, c.kv_heads)]
    cos_h, sin_h = (t[:, : hd // 2].contiguous() for t in rope_tables(s, hd, c.rope_base, dt, dev))
    sin_h = -sin_h  # the old tables: sin itself, not negated
    cos, sin = rope_tables(s, hd, c.rope_base, dt, dev)
    block = Block(c).to_empty(device=dev).to(dt)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rows = {
        "rmsnorm before (op by op)": measure(norm_before, (x, w, c.norm_eps)),
        "rmsnorm after (F.rms_norm)": measure(rms_norm, (x, w, c.norm_eps)),
        "rope + attention before": measure(attention_before, (*qkv, cos_h, sin_h)),
        "rope + attention after": measure(attention_after, (*qkv, cos, sin)),
        "block after": measure(lambda t: block(t, cos, sin), (x,)),
    }
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {a.model}, micro-batch {b}, bf16")
    print(f"F.rms_norm dispatches: forward {ops['forward']}, backward {ops['backward']}")
    print(f"{'part (forward + backward)':32} {'ms':>8} {'kernels':>8}")
    for k, r in rows.items():
        print(f"{k:32} {r['ms']:8.3f} {r['kernels']:8d}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "model": a.model,
                       "micro_batch_size": b, "rms_norm_ops": ops, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
