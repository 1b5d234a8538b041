"""What a compiled region costs the host inside a training step, on a GPU.

benchmarks/region_launches_gpu.py times a compiled region's calls alone, the device
synchronized before each; on two H100 hosts those times (1b-moe's MoE layer: 1.0 + 1.9 ms a
call, 12 layers) would add 35 ms to a step's host where the plan's host is short by 11 ms
(benchmarks/results/gpu/run75_h100_region_launches_calibrated). This times the same calls
inside `playground train`, with no profiler: every function `model.compiled.compiled`
makes is wrapped so that its forward call's host time is summed, and the backward node
its outputs hang from (AOTAutograd's CompiledFunctionBackward: Ansel et al. 2024, "PyTorch
2") gets a pre-hook and a hook that time the host from the node's start to its end.

    torchrun --nproc_per_node 1 benchmarks/region_host_in_step_gpu.py --json F -- train --model 1b-moe ...

Per region (the compiled function's name): calls a step, and the median host µs of a forward
call and of a backward call over the run's last half of calls (past compilation); and the
step's host time in compiled regions, beside the train JSON the run writes (`--json` in the
train arguments) for the step itself.
"""
import argparse
import collections
import json
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import model.compiled as compiled_module  # noqa: E402
import model.cuda_graphs as cuda_graphs_module  # noqa: E402


class RegionTimes:
    """Host seconds of each compiled region's forward and backward calls, by name."""

    def __init__(self):
        self.fwd = collections.defaultdict(list)
        self.bwd = collections.defaultdict(list)

    def wrap(self, make):
        made = {}

        def compiled(fn):
            if fn not in made:
                made[fn] = self._timed(fn.__name__, make(fn))
            return made[fn]
        return compiled

    def _timed(self, name, f):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = f(*args, **kwargs)
            self.fwd[name].append(time.perf_counter() - t0)
            node = _compiled_node(out)
            if node is not None:
                start = []
                node.register_prehook(lambda grads: start.append(time.perf_counter()))
                node.register_hook(lambda gin, gout: self.bwd[name].append(time.perf_counter() - start.pop()))
            return out
        return call

    def table(self, steps: int) -> list:
        rows = []
        for name in sorted(self.fwd):
            f, b = self.fwd[name], self.bwd.get(name, [])
            late = lambda x: x[len(x) // 2:] or [0.0]  # noqa: E731
            rows.append({"region": name, "fwd_calls_per_step": len(f) / steps, "bwd_calls_per_step": len(b) / steps,
                         "host_fwd_s": statistics.median(late(f)), "host_bwd_s": statistics.median(late(b))})
        return rows


def _compiled_node(out):
    """The autograd node of a compiled call's outputs: CompiledFunctionBackward, or the first
    such node one step below a view of it."""
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            node = t.grad_fn
            if "Compiled" not in node.name():
                node = next((n for n, _ in node.next_functions if n is not None and "Compiled" in n.name()), None)
            return node
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--steps", type=int, required=True, help="the train run's --steps")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = a.args[1:] if a.args and a.args[0] == "--" else a.args
    times = RegionTimes()
    compiled_module.compiled = cuda_graphs_module.compiled = times.wrap(compiled_module.compiled)
    from playground.cli import main as playground
    sys.argv = ["playground"] + args
    try:
        playground()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    rows = times.table(a.steps)
    for r in rows:
        print(f"{r['region']:<28} fwd {r['fwd_calls_per_step']:5.1f}/step {r['host_fwd_s'] * 1e6:8.0f} µs   "
              f"bwd {r['bwd_calls_per_step']:5.1f}/step {r['host_bwd_s'] * 1e6:8.0f} µs")
    per_step = sum(r["fwd_calls_per_step"] * r["host_fwd_s"] + r["bwd_calls_per_step"] * r["host_bwd_s"] for r in rows)
    print(f"host in compiled regions: {per_step * 1e3:.1f} ms a step")
    with open(a.json, "w") as f:
        json.dump({"args": args, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                   "torch": torch.__version__, "regions": rows, "host_in_regions_per_step_s": per_step}, f, indent=1)


if __name__ == "__main__":
    main()
