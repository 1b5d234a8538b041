"""Benchmark: checkpoint save and load. For each layout, one training step, then a save
(every rank writes its pieces; replicas once) and a load into a freshly built model of the
same layout and of another (resharding): wall time of each (the slowest rank, barrier to
barrier), bytes on disk, beside the model states a checkpoint must hold (the weights and
AdamW's two moments: 12 bytes per parameter in float32).

    python benchmarks/checkpoint.py                       # small preset, 8 simulated ranks
    torchrun --nproc_per_node 2 benchmarks/checkpoint.py --backend torch --model 350m --layouts dp2,dp2-zero3
Prints a table and writes JSON.
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from benchmarks._common import default_json, print_table, write_json  # noqa: E402
from collectives import launch  # noqa: E402
from collectives.ledger import human_bytes  # noqa: E402
from model import GPT, preset  # noqa: E402
from playground import Layout, RunConfig  # noqa: E402
from playground import checkpoint  # noqa: E402
from playground.parallelize import parallelize  # noqa: E402

LAYOUTS = {
    "dp8": Layout(dp=8), "dp8-zero1": Layout(dp=8, zero=1), "dp8-zero3": Layout(dp=8, zero=3),
    "dp4-tp2": Layout(dp=4, tp=2), "dp2": Layout(dp=2), "dp2-zero3": Layout(dp=2, zero=3),
}
RESHARD_TO = {"dp8": "dp8-zero3", "dp8-zero1": "dp4-tp2", "dp8-zero3": "dp8", "dp4-tp2": "dp8-zero1",
              "dp2": "dp2-zero3", "dp2-zero3": "dp2"}


def _build(world, run, device):
    mesh = run.layout.mesh(world)
    return parallelize(GPT(run.model, dtype=run.param_dtype, device="meta"), mesh, run, device)


def program(world, run, target, folder):
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and run.backend == "torch" else "cpu"
    model = _build(world, run, device)
    cfg = run.model
    batch = torch.randint(0, cfg.vocab_size, (run.layout.micro_batch_size, cfg.seq_len + 1), device=device)
    model.run_step([batch], lambda: __import__("contextlib").nullcontext())
    model.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    world.barrier()
    t0 = time.perf_counter()
    checkpoint.save(world, model, folder, 1, checkpoint.metadata(run, model))
    saved = time.perf_counter() - t0
    out = {"save_s": saved}
    for name, layout in (("same", run.layout), ("reshard", target)):
        other = RunConfig(**{**run.__dict__, "layout": layout})
        fresh = _build(world, other, device)
        world.barrier()
        t0 = time.perf_counter()
        checkpoint.load(fresh, folder, checkpoint.read_index(folder, cfg))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        world.barrier()
        out[f"load_{name}_s"] = time.perf_counter() - t0
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--layouts", default="dp8,dp8-zero1,dp8-zero3,dp4-tp2")
    ap.add_argument("--backend", default="sim", choices=["sim", "torch"])
    ap.add_argument("--dir", help="where to write the checkpoints (default: a temporary folder)")
    ap.add_argument("--json", default=default_json("checkpoint"))
    args = ap.parse_args()
    cfg = preset(args.model)
    rows, out = [], []
    states = 12 * cfg.n_params()
    rank0 = args.backend == "sim" or int(os.environ.get("RANK", "0")) == 0
    for name in args.layouts.split(","):
        layout, target = LAYOUTS[name], LAYOUTS[RESHARD_TO[name]]
        run = RunConfig(model=cfg, layout=Layout(**{**layout.__dict__, "micro_batch_size": 2}), steps=1,
                        backend=args.backend, dtype="float32", progress=False)
        target = Layout(**{**target.__dict__, "micro_batch_size": 2})
        # every process must name the same folder: torchrun's get no shared temporary name
        base = args.dir or (tempfile.mkdtemp(prefix="playground-ckpt-") if args.backend == "sim"
                            else os.path.join(tempfile.gettempdir(), "playground-ckpt-bench"))
        folder = os.path.join(base, name)
        res = launch(program, layout.world, backend=args.backend, args=(run, target, folder))
        worst = {k: max(v[k] for v in res.values) for k in res.values[0]}
        disk = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(folder) for f in fs)
        if rank0:
            shutil.rmtree(folder, ignore_errors=True)
        m = {"layout": name, "reshard_to": RESHARD_TO[name], "bytes_on_disk": disk, "model_states": states, **worst}
        out.append(m)
        rows.append([name, human_bytes(disk), human_bytes(states), f"{disk / states:.3f}", f"{worst['save_s']:.2f} s",
                     f"{worst['load_same_s']:.2f} s", f"{worst['load_reshard_s']:.2f} s → {RESHARD_TO[name]}"])
    if rank0:
        print_table(f"checkpoints of the {args.model} preset ({cfg.n_params():,} parameters), float32, backend "
                    f"{args.backend}; the slowest rank", ["layout", "on disk", "weights + moments", "disk / states",
                                                           "save", "load (same layout)", "load (resharded)"], rows)
        write_json(args.json, {"model": args.model, "backend": args.backend, "results": out})


if __name__ == "__main__":
    main()
