"""The `playground` command: train, check, bench (docs/architecture.md, "One training
step"; README for the tour).

Everything the command is given is checked before any rank starts (the layout, the data
file, the memory a simulated world needs, the backend), and a problem is one line on
stderr naming the values, with exit status 2. Ctrl-C stops a run within a second with
one line and status 130. Heavy modules (torch) are imported only once the arguments are
parsed, so `--help` answers at once.
"""
from __future__ import annotations

import argparse
import ast
import os
import runpy
import sys
import threading

from activation_checkpointing import MODES as AC_MODES
from model.config import DEFAULT_LR, PRESETS
from pipeline.schedules import SCHEDULES
from sequence_parallel.balance import BALANCES, IMPLEMENTATIONS

from .fits import DEFAULT_HEADROOM, check_headroom
from .layout import Layout
from .run_config import DTYPES

# --dtype by verb (argparse's parents share one action among the verbs, so its default is set here)
DEFAULT_DTYPE = {"train": "float32", "check": "float64", "plan": "bfloat16"}

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


class _Help(argparse.HelpFormatter):
    """Every flag's help ends with its default, where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("parallelism-playground")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, formatter_class=_Help)
    g = common.add_argument_group("model and layout")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="model preset")
    g.add_argument("--model-config", help="override the preset's shape: key=value,... over d_model, n_layers, n_heads, "
                                          "n_kv_heads, d_ff, vocab_size, seq_len, attention=flash|unfused, "
                                          "attention_dropout (unfused only), and the MoE fields")
    g.add_argument("--world", type=int, help="number of ranks (default: the product of the axes; under torchrun "
                                             "its process count)")
    for axis, what in (("dp", "data-parallel"), ("tp", "tensor-parallel (Megatron)"), ("pp", "pipeline-parallel"),
                       ("cp", "context-parallel"), ("ep", "expert-parallel (MoE models)")):
        g.add_argument(f"--{axis}", type=int, help=f"{what} degree (default: " +
                       ("what --world leaves over the other axes, else 1)" if axis == "dp" else "1)"))
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                   help="ZeRO stage over dp: 1 optimizer states, 2 and gradients, 3 and parameters; 0 is DDP")
    g.add_argument("--sp", action="store_true", help="sequence parallelism with --tp (Korthikanti et al.)")
    g.add_argument("--cp-impl", default="ring", choices=IMPLEMENTATIONS,
                   help="context parallelism: ring attention (K/V around the ring) or Ulysses (all-to-all to heads)")
    g.add_argument("--cp-balance", default="zigzag", choices=BALANCES,
                   help="which sequence chunks a cp rank holds: zigzag (rank r: chunks r and 2cp-1-r, equal causal "
                        "work) or contiguous (rank r: chunk r)")
    g.add_argument("--ac", default="none", choices=AC_MODES,
                   help="activation checkpointing of every block: full keeps only the block's input, selective also "
                        "its matmul and attention outputs, and backward recomputes the rest (default: none)")
    g.add_argument("--seq-len", type=int, help="sequence length (default: the preset's)")
    m = common.add_argument_group("mixture of experts (the -moe presets, or --experts on any preset)")
    m.add_argument("--experts", type=int, help="experts per MoE block (default: the preset's; 0 for none)")
    m.add_argument("--moe-every", type=int, help="every k-th block has experts (default: the preset's, 1)")
    m.add_argument("--top-k", type=int, help="experts per token (default: the preset's, 2)")
    cap = m.add_mutually_exclusive_group()
    cap.add_argument("--capacity-factor", type=float,
                     help="expert slots per token group: ceil(cf·k·T/E); overflow is dropped (default: the preset's, 1.0)")
    cap.add_argument("--dropless", action="store_true", help="no capacity: every assignment is computed")
    m.add_argument("--aux-loss-coef", type=float, help="Switch load-balancing loss coefficient α (default: 0.01)")
    m.add_argument("--z-loss-coef", type=float, help="ST-MoE router z-loss coefficient β (default: 0.001)")
    g.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule with --pp")
    g.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per step per DP rank (gradient accumulation, or the pipeline's m)")
    g.add_argument("--micro-batch-size", type=int, default=Layout.micro_batch_size, help="sequences per microbatch")
    g.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    g.add_argument("--stage-layers", help="blocks per pipeline stage, comma-separated, e.g. 1,3 (default: even)")
    t = common.add_argument_group("training")
    t.add_argument("--steps", type=int, help="optimizer steps in all (default: 20 for train, 3 for check); a run "
                                              "resumed with --resume continues to this step")
    t.add_argument("--lr", type=float, help="AdamW learning rate (default: the preset's, e.g. "
                                            + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")")
    t.add_argument("--dtype", choices=DTYPES,
                   help="bfloat16: float32 weights with bf16 compute; float16: ZeRO's fp16 compute copies with "
                        "dynamic loss scaling (default: " + ", ".join(f"{d} for {v}" for v, d in DEFAULT_DTYPE.items())
                        + ": a check's PASS proves most in float64)")
    t.add_argument("--bf16-copies", action="store_true",
                   help="--dtype bfloat16 without --zero: bf16 compute copies of the weights with fp32 master weights "
                        "(ZeRO's engine at stage 0, as plan prices it) instead of autocast")
    t.add_argument("--reduce-dtype", choices=DTYPES,
                   help="ZeRO: the dtype gradients are reduced in (default: the compute dtype of --dtype)")
    t.add_argument("--seed", type=int, default=0, help="seed of the weights and of the data")
    t.add_argument("--data", help="'markov' (default: a synthetic chain with a known loss floor), a text file (read "
                                  "as bytes), or token ids (.npy of integers, or .bin of uint16)")
    t.add_argument("--compile", action="store_true",
                   help="torch.compile each block (backends torch and gloo; with --ac none or full)")
    t.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size in MiB")
    t.add_argument("--no-grad-overlap", action="store_true",
                   help="reduce the gradients after the backward instead of during it (DDP in one bucket; ZeRO-0/1 "
                        "unit by unit after it), as Megatron-LM did in 2021")
    t.add_argument("--backend", default="sim", choices=["sim", "gloo", "torch"],
                   help="sim: ranks as threads of this process; gloo: local processes; torch: one rank of a "
                        "torchrun job (NCCL on GPUs)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    o = common.add_argument_group("simulated time and output")
    o.add_argument("--hardware", help="simulate time and memory on a profile: h100-sxm, a100-80gb, h200, or a "
                                      "TOML/JSON file (sim backend)")
    o.add_argument("--count-every-step", action="store_true",
                   help="with --hardware: count the ops of every step (slower) instead of replaying step 2's compute")
    o.add_argument("--trace", help="write a Chrome/Perfetto trace of every rank's simulated time to this file "
                                   "(with --hardware; open it in ui.perfetto.dev)")
    o.add_argument("--plots", help="write PNG plots to this folder (train: loss, bytes by label, with --hardware "
                                   "the last step's timeline and memory; check: the errors per tensor)")
    o.add_argument("--json", help="write a machine-readable summary to this file (schema: docs/json.md)")
    k = common.add_argument_group("checkpoints")
    k.add_argument("--save", help="save a checkpoint in this folder at the end (and every --save-every steps)")
    k.add_argument("--save-every", type=int, help="with --save: also every K steps")
    k.add_argument("--overwrite", action="store_true", help="with --save: replace a checkpoint already there")
    k.add_argument("--resume", help="continue from the checkpoint in this folder, in this run's layout (any)")
    k.add_argument("--init-from", help="start from a state_dict file of the reference GPT (playground export)")

    p = argparse.ArgumentParser(prog="playground", formatter_class=_Help,
                                description="Distributed training on simulated ranks: every byte counted, every "
                                            "layout checked against one device.")
    p.add_argument("--version", action="version", version=f"playground {_version()}")
    sub = p.add_subparsers(dest="verb", required=True, metavar="{train,check,plan,calibrate,export,bench}")
    sub.add_parser("train", parents=[common], formatter_class=_Help,
                   help="train and report loss, throughput, bytes per rank, simulated time and memory")
    sub.add_parser("check", parents=[common], formatter_class=_Help,
                   help="prove a layout computes what one device computes (exit status 0 only if it does)")
    pl = sub.add_parser("plan", parents=[common], formatter_class=_Help,
                        help="what a layout would cost on --hardware: every rank's program on meta tensors (no data)")
    pl.add_argument("--global-batch", type=int, help="sequences per step (default: dp × microbatches × micro-batch "
                                                     "size); sets the microbatches")
    pl.add_argument("--search", action="store_true",
                    help="plan every layout of --world for --global-batch (tp, pp, cp, ep, ZeRO, schedule, micro-batch "
                         "size, --ac) and print the fastest that fit; --tp/--pp/--cp/--ep given fix those axes")
    pl.add_argument("--memory-headroom", type=float, default=DEFAULT_HEADROOM, metavar="F",
                    help="share of HBM a layout must leave free to fit: torch's caching allocator fragments (a 1b run "
                         "at 88%% of an H200 ran out of memory); about 0.02 with PYTORCH_CUDA_ALLOC_CONF="
                         "expandable_segments:True")
    pl.add_argument("--top", type=int, default=10, help="with --search: how many layouts to print")
    pl.add_argument("--exact", type=int, default=3,
                    help="with --search: how many of the fastest to plan in full (the others are estimated from "
                         "shallow plans, marked *)")
    c = sub.add_parser("calibrate", formatter_class=_Help,
                       help="measure this machine's kernels and links and write a hardware profile (--hardware FILE)")
    c.add_argument("--backend", default="torch", choices=["torch", "gloo"],
                   help="torch: every rank of a torchrun job (NCCL on GPUs); gloo: --world local CPU processes")
    c.add_argument("--world", type=int, help="with --backend gloo: the number of processes")
    c.add_argument("--model", default="1b", choices=sorted(PRESETS), help="the model whose shapes are measured")
    c.add_argument("--micro-batch-size", type=int, default=4, help="sequences per microbatch of those shapes")
    c.add_argument("--base", default="h200-datasheet",
                   help="the profile whose peaks, HBM bandwidth and network are kept (datasheet numbers)")
    c.add_argument("--max-mib", type=float, default=1024.0, help="largest collective message, MiB")
    c.add_argument("--name", help="the profile's name (default: the --out file's)")
    c.add_argument("--out", required=True, help="the profile file to write (JSON)")
    e = sub.add_parser("export", formatter_class=_Help,
                       help="write a checkpoint's weights as the reference GPT's plain state_dict")
    e.add_argument("directory", help="the checkpoint folder")
    e.add_argument("file", help="the state_dict file to write (torch.save; GPT.load_state_dict takes it)")
    e.add_argument("--overwrite", action="store_true", help="replace the file if it exists")
    b = sub.add_parser("bench", formatter_class=_Help, help="run a benchmark by name; without a name, list them")
    b.add_argument("name", nargs="?", help="the benchmark (see the list: playground bench)")
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    return p


def benchmarks() -> dict:
    """{name: the first line of its docstring} of the benchmark scripts."""
    out = {}
    if os.path.isdir(BENCHMARKS):
        for f in sorted(os.listdir(BENCHMARKS)):
            if f.endswith(".py") and not f.startswith("_"):
                with open(os.path.join(BENCHMARKS, f)) as fh:
                    doc = ast.get_docstring(ast.parse(fh.read())) or ""
                first = doc.split("\n\n")[0].replace("\n", " ").removeprefix("Benchmark: ").removeprefix("Benchmark ")
                out[f[:-3]] = first.split(". ")[0].rstrip(".")
    return out


def _bench(args) -> int:
    names = benchmarks()
    if args.name is None:
        print("benchmarks (playground bench NAME [ARGS]; each prints a table and writes JSON):")
        for name, doc in names.items():
            print(f"  {name:<22} {doc}")
        return 0
    if args.name not in names:
        print(f"playground bench: no benchmark {args.name!r}; choose one of {sorted(names)}", file=sys.stderr)
        return 2
    path = os.path.join(BENCHMARKS, f"{args.name}.py")
    sys.argv = [path, *args.args]
    runpy.run_path(path, run_name="__main__")
    return 0


def _model_config(text) -> dict:
    """--model-config d_model=512,n_layers=8 -> typed overrides of GPTConfig's fields."""
    from dataclasses import fields

    from model.config import GPTConfig
    if not text:
        return {}
    types = {f.name: f.type for f in fields(GPTConfig)}
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in types or not value:
            raise ValueError(f"--model-config {item!r}: give key=value with a key among {sorted(types)}")
        kind = {"int": int, "float": float, "str": str}.get(str(types[key]), _flag)  # (bool, bool | None)
        try:
            out[key] = kind(value)
        except ValueError:
            raise ValueError(f"--model-config {key}={value}: not a {types[key]}") from None
    return out


def _flag(text: str) -> bool:
    """A boolean --model-config value: true/false, yes/no or 1/0."""
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise ValueError(f"{text!r} is not true or false")
    return value


def _stage_layers(text):
    from .layout import LayoutError
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise LayoutError(f"--stage-layers {text!r}: give comma-separated block counts, e.g. 1,3") from None


def run_config(args, default_steps: int, meta: bool = False):
    """The RunConfig of the arguments, every input checked (raises ValueError naming it)."""
    from model import preset
    from model.data import make_source

    from .capacity import check_simulated_memory
    from .layout import Layout
    from .run_config import RunConfig

    world = args.world
    if args.backend == "torch" and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        raise ValueError("--backend torch runs one rank of a torchrun job, and RANK/WORLD_SIZE are not set: start it "
                         "as `torchrun --nproc_per_node N -m playground ...`, or use --backend gloo for local processes")
    if world is None and args.backend == "torch":
        world = int(os.environ["WORLD_SIZE"])  # under torchrun the world is its process count
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps {args.steps}: must be at least 1")
    layout = Layout.from_counts(
        world=world, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero,
        schedule=args.schedule, microbatches=args.microbatches, virtual_stages=args.virtual_stages,
        sequence_parallel=args.sp, micro_batch_size=args.micro_batch_size,
        stage_layers=_stage_layers(args.stage_layers), cp_impl=args.cp_impl, cp_balance=args.cp_balance,
        ac=args.ac)
    if args.seq_len is not None and args.seq_len < 2:
        raise ValueError(f"--seq-len {args.seq_len}: must be at least 2")
    overrides = {k: v for k, v in (("seq_len", args.seq_len), ("n_experts", args.experts), ("moe_every", args.moe_every),
                                   ("top_k", args.top_k), ("capacity_factor", args.capacity_factor),
                                   ("aux_loss_coef", args.aux_loss_coef), ("z_loss_coef", args.z_loss_coef))
                 if v is not None}
    if args.dropless:
        overrides["capacity_factor"] = 0.0
    overrides.update(_model_config(args.model_config))
    cfg = preset(args.model, **overrides)
    layout.validate(cfg)
    if args.hardware:
        from simulator import load_hardware
        load_hardware(args.hardware)  # an unknown profile fails here, before any work
    for flag, path in (("--plots", args.plots), ("--json", args.json), ("--trace", args.trace)):
        if path and flag == "--plots" and os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"--plots {path}: exists and is not a folder")
        if path and flag != "--plots" and os.path.isdir(path):
            raise ValueError(f"{flag} {path}: is a folder; give a file name")
    if args.trace and not args.hardware:
        raise ValueError("--trace needs --hardware: without a profile there is no simulated time to draw")
    make_source(args.data, cfg.vocab_size, args.seed, cfg.seq_len)  # a bad data file fails here
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.model]
    run = RunConfig(model=cfg, layout=layout, steps=args.steps or default_steps, lr=lr,
                    dtype=args.dtype or DEFAULT_DTYPE[args.verb],
                    reduce_dtype=args.reduce_dtype, seed=args.seed, data=args.data, bucket_cap_mb=args.bucket_mb,
                    grad_overlap=not args.no_grad_overlap,
                    backend=args.backend, progress=not args.no_progress, hardware=args.hardware,
                    count_every_step=args.count_every_step, save=args.save, save_every=args.save_every,
                    resume=args.resume, init_from=args.init_from, compile=args.compile,
                    bf16_copies=bool(getattr(args, "bf16_copies", False)))
    _check_checkpoints(args, run)
    if run.backend == "sim" and not meta:  # (a plan's ranks hold meta tensors: no memory)
        check_simulated_memory(run)
    return run


def _check_checkpoints(args, run) -> None:
    """--resume, --save and --init-from, checked before any rank starts."""
    from .checkpoint import CheckpointError, has_checkpoint, read_index, resume_point
    if args.resume:
        resume_point(read_index(args.resume, run.model), args.resume, run)
    if args.save:
        if os.path.exists(args.save) and not os.path.isdir(args.save):
            raise CheckpointError(f"--save {args.save}: exists and is not a folder")
        same = args.resume and os.path.abspath(args.resume) == os.path.abspath(args.save)
        if has_checkpoint(args.save) and not args.overwrite and not same:
            step = read_index(args.save)["step"]
            raise CheckpointError(f"--save {args.save}: holds a checkpoint (step {step}); add --overwrite to replace "
                                  f"it, or choose another folder")
    if args.init_from:
        _check_state_dict(args.init_from, run.model)


def _check_state_dict(path: str, cfg) -> None:
    import torch

    from model import GPT
    from .checkpoint import CheckpointError
    if not os.path.exists(path):
        raise CheckpointError(f"--init-from {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one message
        raise CheckpointError(f"--init-from {path}: not a state_dict torch can load without pickle "
                              f"({type(e).__name__})") from None
    want = {n: tuple(p.shape) for n, p in GPT(cfg, device="meta").named_parameters()}
    if not isinstance(state, dict):
        raise CheckpointError(f"--init-from {path}: holds a {type(state).__name__}, not a state_dict")
    missing = sorted(set(want) - set(state))
    if missing:
        raise CheckpointError(f"--init-from {path}: lacks {len(missing)} parameters of this model, e.g. {missing[0]}")
    wrong = [f"{n} {tuple(state[n].shape)} != {s}" for n, s in want.items() if tuple(state[n].shape) != s]
    if wrong:
        raise CheckpointError(f"--init-from {path}: a state_dict of another model ({wrong[0]})")


def _export(args) -> int:
    import torch

    from .checkpoint import CheckpointError, export
    try:
        if os.path.exists(args.file) and not args.overwrite:
            raise CheckpointError(f"{args.file}: exists; add --overwrite to replace it")
        state = export(args.directory)
    except CheckpointError as e:
        print(f"playground export: {e}", file=sys.stderr)
        return 2
    tmp = args.file + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, args.file)
    n = sum(t.numel() for t in state.values())
    print(f"playground export: {args.file}: {len(state)} tensors, {n:,} parameters (the reference GPT's state_dict)")
    return 0


def _is_rank0(backend: str) -> bool:
    return backend != "torch" or int(os.environ.get("RANK", "0")) == 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:
        print(f"\nplayground {args.verb}: interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        if any(t.name.startswith("sim-rank-") and t.is_alive() for t in threading.enumerate()):
            # simulated ranks may be inside torch ops: leave at once, without the interpreter's
            # teardown (which would wait on them, or abort while they run)
            os._exit(130)
        return 130
    finally:
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():  # torchrun: leave NCCL/gloo cleanly
                import torch
                cuda = dist.get_backend() == "nccl"
                dist.barrier(device_ids=[torch.cuda.current_device()] if cuda else None)
                dist.destroy_process_group()


def _main(args) -> int:
    if args.verb == "bench":
        return _bench(args)
    if args.verb == "export":
        return _export(args)
    from collectives import CollectiveError, RankFailedError
    if args.verb == "calibrate":
        return _calibrate(args)
    from model.data import DataError

    from .layout import LayoutError
    if args.verb == "plan":
        if not args.hardware:
            print("playground plan: --hardware is required (h100-sxm, a100-80gb, h200 or a profile file)",
                  file=sys.stderr)
            return 2
        given = [f for f, v in (("--save", args.save), ("--resume", args.resume), ("--init-from", args.init_from),
                                ("--data", args.data), ("--count-every-step",
                                args.count_every_step), ("--backend", args.backend != "sim"),
                                ("--compile", args.compile)) if v]
        if given:
            print(f"playground plan: {', '.join(given)} belong to train: a plan runs no data and keeps no weights",
                  file=sys.stderr)
            return 2
        try:
            check_headroom(args.memory_headroom)
        except ValueError as e:
            print(f"playground plan: {e}", file=sys.stderr)
            return 2
        if args.search:
            return _search(args)
        if args.global_batch is not None:
            dp, mbs = args.dp or 1, args.micro_batch_size
            if args.global_batch % (dp * mbs):
                print(f"playground plan: --global-batch {args.global_batch} is not divisible by dp × micro-batch size = "
                      f"{dp} × {mbs}", file=sys.stderr)
                return 2
            args.microbatches = args.global_batch // (dp * mbs)
    try:
        run = run_config(args, default_steps=20 if args.verb == "train" else 3, meta=args.verb == "plan")
        if args.verb == "check" and (args.save or args.resume):
            raise ValueError("check compares training from the start against one device: --save and --resume "
                             "belong to train")
        if args.verb == "check":
            from .equivalence import checkable
            checkable(run)
    except (LayoutError, DataError, ValueError, FileNotFoundError) as e:  # includes an unknown --hardware
        print(f"playground {args.verb}: {e}", file=sys.stderr)
        return 2
    try:
        if args.verb == "plan":
            return _plan(args, run)
        return _train(args, run) if args.verb == "train" else _check(args, run)
    except RankFailedError as e:  # one line: the rank and what it raised
        cause = e.__cause__
        where = f": {type(cause).__name__}: {cause}" if cause is not None else f": {str(e).splitlines()[0]}"
        print(f"playground {args.verb}: rank {e.rank} failed{where}", file=sys.stderr)
        return 1
    except CollectiveError as e:  # a mismatch or a deadlock: the message names every rank
        print(f"playground {args.verb}: {e}", file=sys.stderr)
        return 1


def _calibrate(args) -> int:
    from model.config import preset

    from simulator.hardware import load_hardware

    from .calibrate import calibrate, summary, write_profile
    if args.backend == "gloo" and not args.world:
        print("playground calibrate: --backend gloo needs --world N (the processes to start)", file=sys.stderr)
        return 2
    if args.backend == "torch" and "RANK" not in os.environ:
        print("playground calibrate: --backend torch runs under torchrun (torchrun --nproc_per_node N -m playground "
              "calibrate ...); or use --backend gloo --world N", file=sys.stderr)
        return 2
    name = args.name or os.path.splitext(os.path.basename(args.out))[0]
    try:
        load_hardware(args.base)
    except ValueError as e:  # an unknown --base, before minutes of measuring
        print(f"playground calibrate: --base: {e}", file=sys.stderr)
        return 2
    hw, record = calibrate(args.backend, args.world, preset(args.model), args.micro_batch_size, args.base,
                           args.max_mib, name)
    if _is_rank0(args.backend):
        write_profile(hw, record, args.out)
        print(summary(hw, record))
        print(f"wrote {args.out} (use it as --hardware {args.out})")
    return 0


def _train(args, run) -> int:
    from .report import train_summary
    from .training import train
    res = train(run)
    if not _is_rank0(run.backend):
        return 0
    print(train_summary(res))

    def plots(directory):  # (matplotlib is imported only when asked for)
        from .plots import write_plots
        return write_plots(res, directory)
    from .summary import train_json
    _write_outputs(args, lambda path: _trace(path, res.ledger, res.clocks), plots, lambda: train_json(res))
    return 0


def _plan(args, run) -> int:
    from .planning import plan, plan_json, summary
    p = plan(run)
    print(summary(p, args.memory_headroom))

    def plots(directory):
        from .plots import write_plan_plots
        return write_plan_plots(p, directory)
    _write_outputs(args, lambda path: _trace(path, p.ledger, p.clocks, p.ran), plots, lambda: plan_json(p, args.memory_headroom))
    return 0


def _search(args) -> int:
    from .search import search, search_summary
    if args.world is None or args.global_batch is None:
        print("playground plan --search: give --world N and --global-batch B (the layouts are what it finds)",
              file=sys.stderr)
        return 2
    given = [f for f, v in (("--json", args.json), ("--plots", args.plots), ("--trace", args.trace)) if v]
    if given:
        print(f"playground plan --search: {', '.join(given)} describe one plan: plan the layout the search found",
              file=sys.stderr)
        return 2
    fixed = {"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep}
    args.dp = args.tp = args.pp = args.cp = args.ep = None  # the template's layout: dp = world
    try:
        run = run_config(args, default_steps=3, meta=True)
    except ValueError as e:
        print(f"playground plan: {e}", file=sys.stderr)
        return 2
    if args.exact < 1:
        print(f"playground plan --search: --exact {args.exact}: plan at least the fastest layout in full",
              file=sys.stderr)
        return 2
    res = search(run, args.world, args.global_batch, fixed, exact=args.exact, headroom=args.memory_headroom)
    print(search_summary(res, run, args.top))
    return 0 if res.fits else 1


def _trace(path, ledger, clocks, ranks=None) -> str:
    from simulator.trace import write_chrome_trace

    from .report import _rank_ranges
    write_chrome_trace(path, ledger, clocks, ranks)
    which = "" if ranks is None else f", the ranks that ran ({_rank_ranges(ranks)})"
    return f"trace: {path}{which} (open it in ui.perfetto.dev or chrome://tracing)"


def _write_outputs(args, trace, plots, payload) -> None:
    """--trace, --plots and --json of train and plan, each from its own writer."""
    if args.trace:
        print("\n" + trace(args.trace))
    if args.plots:
        print("\nplots: " + ", ".join(plots(args.plots)))
    if args.json:
        from .summary import write_json
        write_json(args.json, payload())
        print(f"\njson: {args.json}")


def _check(args, run) -> int:
    from .equivalence import check
    from .report import check_summary
    rep = check(run)
    if _is_rank0(run.backend):
        print(check_summary(rep))
        if args.plots:
            from .plots import write_check_plot
            print("\nplots: " + write_check_plot(rep, args.plots))
        if args.json:
            from .summary import check_json, write_json
            write_json(args.json, check_json(rep))
            print(f"\njson: {args.json}")
    return 0 if rep.passed else 1
