"""Benchmark: the shared experts (DeepSeekMoE, Dai et al. 2024) run while the combine's
all-to-all is in flight, forward and backward (moe/dispatch.py, as Megatron-Core overlaps
its shared experts with the token exchange), against the same layer running them after the
combine. Plans 1b-dsmoe (16 routed experts, top-4, 1 shared) at ep 2 × dp 2 on two H200s
of one node, dropless and at a capacity, at micro-batch 4 and 8: the step, its exposed
communication, and the device waiting for the host; and the tokens/s per GPU against the
same model on one GPU (ep 1) at the same micro-batch. A plan, not a measurement: the GPU
measurement waits for two lent GPUs. Writes JSON.
"""
import argparse
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
import moe.dispatch as dispatch  # noqa: E402
from model import preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground.planning import plan  # noqa: E402


def after_the_combine(x, group, out_splits, in_splits, label, during):
    """The shared experts after the combine has been waited for (the layer before this change)."""
    return dispatch.all_to_all(x, group, out_splits, in_splits, label), during()


def step(run) -> dict:
    s = plan(run).values[0]["step"]
    return {k: s[k] for k in ("time", "compute", "host", "exposed_comm", "idle")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=default_json("moe_overlap"))
    a = ap.parse_args()
    rows, beside_fn = [], dispatch.all_to_all_during
    for capacity_factor in (0.0, 1.0):
        for mbs in (4, 8):
            run = RunConfig(model=preset("1b-dsmoe").with_(capacity_factor=capacity_factor),
                            layout=Layout(ep=2, dp=2, micro_batch_size=mbs), dtype="bfloat16", bf16_copies=True,
                            hardware="h200", progress=False)
            t0 = time.perf_counter()
            one = step(RunConfig(**{**run.__dict__, "layout": Layout(micro_batch_size=mbs)}))
            beside = step(run)
            dispatch.all_to_all_during = after_the_combine
            try:
                after = step(run)
            finally:
                dispatch.all_to_all_during = beside_fn
            rows.append({"routing": "dropless" if not capacity_factor else f"capacity {capacity_factor}",
                         "micro_batch": mbs, "beside": beside, "after": after, "one_gpu": one,
                         # tokens/s per GPU, ep 2 × dp 2 (twice the tokens on two GPUs) over ep 1
                         "per_gpu_vs_ep1": one["time"] / beside["time"], "wall_s": time.perf_counter() - t0})
    ms = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    print_table("1b-dsmoe, ep 2 × dp 2 on h200 (planned): the shared experts beside the combine against after it",
                ["routing", "micro-batch", "step beside", "step after", "beside / after", "exposed beside",
                 "exposed after", "host beside", "host after", "1 GPU (ep 1)", "per GPU / ep 1"],
                [[r["routing"], r["micro_batch"], ms(r["beside"]["time"]), ms(r["after"]["time"]),
                  f"{r['beside']['time'] / r['after']['time']:.3f}", ms(r["beside"]["exposed_comm"]),
                  ms(r["after"]["exposed_comm"]), ms(r["beside"]["host"]), ms(r["after"]["host"]),
                  ms(r["one_gpu"]["time"]), f"{r['per_gpu_vs_ep1']:.2f}"] for r in rows])
    write_json(a.json, {"benchmark": "moe_overlap", "rows": rows})


if __name__ == "__main__":
    main()
