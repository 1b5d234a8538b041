"""The `playground` command: train, check, bench (docs/architecture.md, The command)."""
from __future__ import annotations

import argparse
import os
import runpy
import sys

from model import DEFAULT_LR, PRESETS, preset

from .layout import SCHEDULES, Layout, LayoutError
from .run_config import DTYPES, RunConfig



def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("model and layout")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    g.add_argument("--world", type=int, help="number of ranks (default: the product of the axes)")
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        g.add_argument(f"--{axis}", type=int, help=f"{axis} degree (default 1; dp takes what --world leaves)")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    g.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    g.add_argument("--microbatches", type=int, default=1, help="microbatches per step per DP rank "
                                                                "(gradient accumulation)")
    g.add_argument("--micro-batch-size", type=int, default=4, help="sequences per microbatch (default 4)")
    g.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    g.add_argument("--stage-layers", help="blocks per pipeline stage, comma-separated (default: even), e.g. 1,3")
    t = common.add_argument_group("training")
    t.add_argument("--steps", type=int)
    t.add_argument("--lr", type=float, help="AdamW learning rate (default: the preset's, e.g. 3e-3 tiny, 3e-4 350m)")
    t.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="bfloat16: float32 weights with bf16 autocast compute")
    t.add_argument("--reduce-dtype", choices=sorted(DTYPES),
                   help="ZeRO: the dtype gradients are reduced in (default: the compute dtype of --dtype)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data", help="'markov' (default: synthetic, known loss floor), a text file, or tokens "
                                  "(.npy, or .bin of uint16)")
    t.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size in MiB")
    t.add_argument("--backend", default="sim", choices=["sim", "gloo", "torch"],
                   help="sim: threads in this process; gloo: local processes; torch: under torchrun")
    t.add_argument("--no-progress", action="store_true")
    o = common.add_argument_group("simulated time and output")
    o.add_argument("--hardware", help="simulate time on a profile: h100-sxm, a100-80gb, h200, or a TOML/JSON file "
                                      "(sim backend)")
    o.add_argument("--trace", help="write a Chrome/Perfetto trace of the simulated time of every rank "
                                   "(with --hardware; open in ui.perfetto.dev)")
    o.add_argument("--count-every-step", action="store_true",
                   help="with --hardware: count the ops of every step (slower) instead of replaying step 2's compute "
                        "on later steps")
    o.add_argument("--plots", help="write PNG plots to this folder: loss, bytes by label; with --hardware also "
                                   "the timeline of the last step and memory by category")

    p = argparse.ArgumentParser(prog="playground", description="Distributed training on simulated ranks.")
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("train", parents=[common], help="train and report loss, throughput and bytes per rank")
    sub.add_parser("check", parents=[common], help="prove a layout matches one device (exit 0 only if it does)")
    b = sub.add_parser("bench", help="run a benchmark script from benchmarks/ by name")
    b.add_argument("name")
    b.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _stage_layers(text):
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise LayoutError(f"--stage-layers {text!r}: give comma-separated block counts, e.g. 1,3") from None


def run_config(args, default_steps: int) -> RunConfig:
    world = args.world
    if world is None and args.backend == "torch" and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])  # under torchrun the world is its process count
    layout = Layout.from_counts(
        world=world, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero,
        schedule=args.schedule, microbatches=args.microbatches, virtual_stages=args.virtual_stages,
        sequence_parallel=args.sp, micro_batch_size=args.micro_batch_size,
        stage_layers=_stage_layers(args.stage_layers))
    cfg = preset(args.model)
    layout.validate(cfg)
    if args.hardware:
        from simulator.hardware import load_hardware
        load_hardware(args.hardware)  # an unknown profile fails here, before any work
    if getattr(args, "plots", None) and os.path.exists(args.plots) and not os.path.isdir(args.plots):
        raise ValueError(f"--plots {args.plots}: exists and is not a folder")
    if args.trace and not args.hardware:
        raise ValueError("--trace needs --hardware: without a profile there is no simulated time to draw")
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.model]
    return RunConfig(model=cfg, layout=layout, steps=args.steps or default_steps, lr=lr, dtype=args.dtype,
                     reduce_dtype=args.reduce_dtype,
                     seed=args.seed, data=args.data, bucket_cap_mb=args.bucket_mb, backend=args.backend,
                     progress=not args.no_progress, hardware=args.hardware,
                     count_every_step=args.count_every_step)


def _is_rank0(backend: str) -> bool:
    return backend != "torch" or int(os.environ.get("RANK", "0")) == 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    finally:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():  # torchrun: leave NCCL/gloo cleanly
            import torch
            cuda = dist.get_backend() == "nccl"
            dist.barrier(device_ids=[torch.cuda.current_device()] if cuda else None)
            dist.destroy_process_group()


def _main(args) -> int:
    if args.verb == "bench":
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.path.join(root, "benchmarks", f"{args.name}.py")
        if not os.path.exists(path):
            names = sorted(f[:-3] for f in os.listdir(os.path.join(root, "benchmarks"))
                           if f.endswith(".py") and not f.startswith("_"))
            print(f"playground bench: no benchmark {args.name!r}; choose one of {names}", file=sys.stderr)
            return 2
        sys.argv = [path, *args.args]
        runpy.run_path(path, run_name="__main__")
        return 0
    try:
        run = run_config(args, default_steps=20 if args.verb == "train" else 3)
    except (LayoutError, ValueError, FileNotFoundError) as e:  # includes an unknown --hardware
        print(f"playground {args.verb}: {e}", file=sys.stderr)
        return 2
    from .report import check_summary, train_summary
    if args.verb == "train":
        from .train import train
        res = train(run)
        if _is_rank0(run.backend):
            print(train_summary(res))
            if args.trace:
                from simulator.trace import write_chrome_trace
                write_chrome_trace(args.trace, res.ledger, res.clocks)
                print(f"\ntrace: {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
            if args.plots:
                from .plots import write_plots
                print("\nplots: " + ", ".join(write_plots(res, args.plots)))
        return 0
    from .check import check
    rep = check(run)
    if _is_rank0(run.backend):
        print(check_summary(rep))
    return 0 if rep.passed else 1
