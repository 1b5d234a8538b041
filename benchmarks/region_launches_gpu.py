"""What a compiled region costs the host on a GPU, against the ops of the graphs a plan runs.

A plan issues a compiled region (model/compiled.py) as one host call for its forward and
one for its backward (simulator/compute_model.py, `compiled`), where Inductor's code
launches each of the region's kernels from Python (Ansel et al. 2024, "PyTorch 2": the
generated `call` issues one Triton or library launch after the other). On one H100's host
1b-moe's step issued for 81.6 ms against the plan's 53.6 (benchmarks/results/gpu/
run71_h100_moe_recompute_profiles: 1817 kernels a step on the device, 862 ops in the plan).
This measures, per region at the shapes of a 1b-moe step (micro-batch 4; and 1b-dsmoe's
whole layer), what a host-cost model for compiled regions would be fitted and checked on:

- `kernels fwd` / `kernels bwd`: kernels and copies the device ran for one compiled forward
  call and for its backward (torch.autograd.grad from the outputs, gradients of ones: no
  gradient accumulation; the ones made inside it count), counted by the torch profiler's
  CUDA activity;
- `host fwd` / `host bwd`: the host's wall time until each call returns (the device
  synchronized before each; median of repeats), and the eager function's forward beside it
  (`host eager fwd`, `eager ops fwd`: the aten ops it dispatches, each one launch or none);
- `graph ops fwd` / `graph ops bwd`: the ops of the partition's forward and backward graphs
  (`model.compiled._traced`, as a plan runs them: call_function nodes that are not views),
  of which `matmuls` (mm, bmm, addmm, _grouped_mm) and `recomputed` (backward nodes that
  take no gradient, which Inductor fuses into their consumers).

    python benchmarks/region_launches_gpu.py [--json F]

On a machine without a GPU (or without torch._grouped_mm's kernels) only the graphs' columns
are filled.
"""
import argparse
import operator
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from benchmarks._common import print_table, write_json  # noqa: E402
from benchmarks.region_memory_gpu import measured_regions  # noqa: E402
from model.compiled import _signature, _traced, compiled  # noqa: E402

MATMULS = {"mm", "bmm", "addmm", "_grouped_mm"}


def graph_ops(gm, recomputed=frozenset()) -> dict:
    """{ops, matmuls, recomputed}: the graph's call_function nodes that are not views."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and not _is_view(n.target)]
    return {"ops": len(ops), "matmuls": sum(_packet(n.target) in MATMULS for n in ops),
            "recomputed": sum(n.name in recomputed for n in ops), "names": [_packet(n.target) for n in ops]}


def _packet(target) -> str:
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", str(target))


def _is_view(target) -> bool:
    return (target is operator.getitem or bool(getattr(target, "is_view", False))
            or _packet(target) in ("_unsafe_view", "view"))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _differentiable(out, args):
    outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return outs, wrt


def host_seconds(call, repeats: int = 10, setup=None) -> float:
    """Median host wall time of `call()` until it returns, after `setup()` (untimed) and the
    device synchronized."""
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(samples)


def device_kernels(call, setup=None) -> list:
    """The names of the kernels and copies the device ran for `call()`, after `setup()` (not
    recorded): the torch profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile
    if setup is not None:
        setup()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def measure(fn, args) -> dict:
    """The compiled region's forward and backward on the GPU (each backward after a forward of
    its own: a compiled backward frees its graph's buffers), and its eager forward."""
    f = compiled(fn)
    kept = {}

    def forward():
        kept["outs"] = _differentiable(f(*args), args)

    def backward():
        outs, wrt = kept.pop("outs")
        torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True)
    for _ in range(2):  # (compiled, its backward made at the first backward)
        forward()
        backward()
    names_fwd, names_bwd = device_kernels(forward), device_kernels(backward, setup=forward)
    r = {"kernels_fwd": len(names_fwd), "host_fwd_s": host_seconds(forward), "kernel_names_fwd": names_fwd,
         "kernels_bwd": len(names_bwd), "host_bwd_s": host_seconds(backward, setup=forward), "kernel_names_bwd": names_bwd}
    counting = _CountOps()
    with counting:
        fn(*args)
    r["eager_ops_fwd"], r["host_eager_fwd_s"] = counting.ops, host_seconds(lambda: fn(*args))
    return r


def _scale_shift(x):
    return x * 2.0 + 1.0


def _one_kernel(gpu: bool):
    """The least a compiled region costs: one pointwise kernel each way, as measured_regions
    yields its regions."""
    x = torch.randn(4096, device="cuda" if gpu else "cpu", requires_grad=True)
    yield "-", "one_pointwise", _scale_shift, (x,), (torch.empty(4096, device="meta", requires_grad=True),), gpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    rows, out = [], {"device": torch.cuda.get_device_name() if gpu else "none (graph columns only)",
                     "torch": torch.__version__, "regions": []}
    for model, name, fn, args, meta_args, measure_gpu in (*_one_kernel(gpu), *measured_regions(gpu)):
        graphs = _traced(fn, name, tuple(_signature(x) for x in meta_args))
        fw = graph_ops(graphs.forward)
        bw = graph_ops(graphs.backward, graphs.recomputed) if graphs.backward is not None else {}
        r = {"model": model, "region": name, "graph_fwd": fw, "graph_bwd": bw}
        if measure_gpu:
            r.update(measure(fn, args))
        out["regions"].append(r)
        us = lambda k: f"{r[k] * 1e6:.0f}" if k in r else "-"  # noqa: E731
        rows.append([model, name, r.get("kernels_fwd", "-"), r.get("kernels_bwd", "-"), us("host_fwd_s"),
                     us("host_bwd_s"), r.get("eager_ops_fwd", "-"), us("host_eager_fwd_s"),
                     f"{fw['ops']} ({fw['matmuls']} matmuls)",
                     f"{bw['ops']} ({bw['matmuls']} matmuls, {bw['recomputed']} recomputed)" if bw else "-"])
    print_table(f"A compiled region's launches and host time per call (device: {out['device']}, torch {torch.__version__}; "
                f"µs)", ["model", "region", "kernels fwd", "kernels bwd", "host fwd", "host bwd", "eager ops fwd",
                         "host eager fwd", "graph ops fwd", "graph ops bwd"], rows)
    if a.json:
        write_json(a.json, out)


if __name__ == "__main__":
    main()
