"""Every input of `train`, `check` and `plan` checked before the work starts
(docs/architecture.md, "The front door").

The checks run in two passes. The first needs no tensor and imports no torch, so a bad
flag answers at once: flags that would silently do nothing (a pipeline schedule without a
pipeline, MoE settings on a dense model, a repeated --model-config key), the layout against
the model, the hardware profile, every output path (probed for writing now, not after the
run), and on simulated ranks the memory the world needs and the time it would take. The
second reads what needs torch or NumPy: the data file, checkpoints, a state_dict. Each
problem is an `InputError` whose message names the flag and the values involved.
"""
from __future__ import annotations

import math
import os
import tempfile

from .flags import DEFAULT_DTYPE, DEFAULT_STEPS
from .layout import Layout, LayoutError

# the GPTConfig field each flag sets (a config error names the flag the user typed)
FIELD_FLAGS = {"n_experts": "--experts", "top_k": "--top-k", "moe_every": "--moe-every",
               "capacity_factor": "--capacity-factor", "aux_loss_coef": "--aux-loss-coef",
               "z_loss_coef": "--z-loss-coef", "seq_len": "--seq-len", "aux_loss": "--aux-loss", "router": "--router",
               "bias_update_rate": "--bias-update-rate", "n_shared_experts": "--shared-experts",
               "expert_d_ff": "--expert-d-ff"}
MOE_FLAGS = ("--top-k", "--moe-every", "--capacity-factor", "--dropless", "--aux-loss-coef", "--z-loss-coef",
             "--aux-loss", "--router", "--bias-update-rate", "--shared-experts", "--expert-d-ff")


class InputError(ValueError):
    """An input the run cannot take, named with its values."""


# -- outputs ----------------------------------------------------------------------------------
def writable(flag: str, path: str, folder: bool = False) -> None:
    """Raise InputError unless `path` (a file, or a `folder`) can be written: it is not the
    wrong kind of thing, and the nearest folder that exists above it takes a new file."""
    target = os.path.abspath(path)
    flag = f"{flag} " if flag else ""
    if folder and os.path.exists(target) and not os.path.isdir(target):
        raise InputError(f"{flag}{path}: exists and is not a folder")
    if not folder and os.path.isdir(target):
        raise InputError(f"{flag}{path}: is a folder; give a file name")
    probe = target if folder else os.path.dirname(target)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise InputError(f"{flag}{path}: {probe} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(dir=probe, prefix=".playground-probe-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise InputError(f"{flag}{path}: cannot write in {probe} ({e.strerror})") from None


def _outputs(args) -> None:
    for flag, dest, folder in (("--json", "json", False), ("--trace", "trace", False), ("--plots", "plots", True),
                               ("--save", "save", True)):
        path = getattr(args, dest, None)
        if path:
            writable(flag, path, folder)


# -- flags that would do nothing ------------------------------------------------------------
def _needs(typed: set, args, layout: Layout, cfg) -> None:
    """Refuse a flag given where it has no effect (it would be silently ignored)."""
    rules = [
        ("--schedule", layout.pp == 1, f"--schedule {args.schedule} needs --pp 2 or more: one stage has no schedule"),
        ("--virtual-stages", layout.pp == 1, "--virtual-stages needs --pp 2 or more and --schedule interleaved"),
        ("--stage-layers", layout.pp == 1, "--stage-layers needs --pp 2 or more: one stage holds every block"),
        ("--cp-impl", layout.cp == 1, f"--cp-impl {args.cp_impl} needs --cp 2 or more: without it attention is "
                                      f"not split"),
        ("--cp-balance", layout.cp == 1, f"--cp-balance {args.cp_balance} needs --cp 2 or more"),
        ("--sp", layout.tp == 1, "--sp splits the sequence over tensor-parallel ranks: it needs --tp 2 or more"),
        ("--overwrite", not getattr(args, "save", None), "--overwrite replaces a checkpoint: it needs --save DIR"),
        ("--count-every-step", not getattr(args, "hardware", None), "--count-every-step counts simulated time: it "
                                                                    "needs --hardware"),
        ("--bucket-mb", bool(layout.zero), f"--bucket-mb sizes DDP's buckets, and ZeRO-{layout.zero} reduces its "
                                           f"gradients unit by unit"),
        ("--bucket-mb", getattr(args, "no_grad_overlap", False), "--bucket-mb with --no-grad-overlap: the "
                                                                 "gradients are then reduced in one bucket"),
    ]
    for flag, idle, message in rules:
        if flag in typed and idle:
            raise InputError(message)
    if not cfg.n_experts:
        moe = [f for f in MOE_FLAGS if f in typed]
        if moe:
            raise InputError(f"{moe[0]} sets the experts' routing, and model {args.model} has none: add --experts N "
                             f"or choose a -moe preset")
    if "--capacity-factor" in typed and args.dropless:
        raise InputError(f"--capacity-factor {args.capacity_factor} and --dropless: give one (dropless has no "
                         f"capacity)")
    if args.verb == "plan" and not args.search:
        for flag in ("--top", "--exact", "--jobs"):
            if flag in typed:
                raise InputError(f"{flag} is an option of --search: add --search")


def _exist(args) -> None:
    """The files and folders the run reads, there (their contents are read in `check_files`)."""
    data = getattr(args, "data", None)
    if data and data != "markov" and not os.path.exists(data):
        raise InputError(f"--data {data}: no such file")
    for flag, dest, folder in (("--resume", "resume", True), ("--init-from", "init_from", False)):
        path = getattr(args, dest, None)
        if path and not (os.path.isdir(path) if folder else os.path.isfile(path)):
            raise InputError(f"{flag} {path}: no such {'checkpoint folder' if folder else 'file'}")


# -- the model --------------------------------------------------------------------------------
def model_config(text) -> dict:
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
            raise InputError(f"--model-config {item!r}: give key=value with a key among {sorted(types)}")
        if key in out:
            raise InputError(f"--model-config: {key} given twice")
        kind = {"int": int, "float": float, "str": str}.get(str(types[key]), _flag)  # (bool, bool | None)
        try:
            out[key] = kind(value)
        except ValueError:
            raise InputError(f"--model-config {key}={value}: not {'an' if str(types[key]) == 'int' else 'a'} "
                             f"{types[key]}") from None
        if kind is float and not math.isfinite(out[key]):
            raise InputError(f"--model-config {key}={value}: must be finite")
    return out


def _flag(text: str) -> bool:
    """A boolean --model-config value: true/false, yes/no or 1/0."""
    value = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise ValueError(f"{text!r} is not true or false")
    return value


def _model(args, typed: set):
    from model.config import preset
    overrides = {k: v for k, v in (("seq_len", args.seq_len), ("n_experts", args.experts),
                                   ("moe_every", args.moe_every), ("top_k", args.top_k),
                                   ("capacity_factor", args.capacity_factor), ("aux_loss_coef", args.aux_loss_coef),
                                   ("z_loss_coef", args.z_loss_coef), ("aux_loss", args.aux_loss),
                                   ("router", args.router.replace("-", "_") if args.router else None),
                                   ("bias_update_rate", args.bias_update_rate),
                                   ("n_shared_experts", args.shared_experts), ("expert_d_ff", args.expert_d_ff))
                 if v is not None}
    if args.dropless:
        overrides["capacity_factor"] = 0.0
    extra = model_config(args.model_config)
    both = sorted(set(overrides) & set(extra))
    if both:
        raise InputError(f"--model-config {both[0]}= and {FIELD_FLAGS[both[0]]}: give it once")
    try:
        return preset(args.model, **overrides, **extra)
    except ValueError as e:
        named = [FIELD_FLAGS[f] for f in FIELD_FLAGS if f"{f}=" in str(e) and FIELD_FLAGS[f] in typed]
        where = f" ({', '.join(named)})" if named else (" (--model-config)" if extra else "")
        raise InputError(f"model {args.model}: {e}{where}") from None


def _stage_layers(text):
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise LayoutError(f"--stage-layers {text!r}: give comma-separated block counts, e.g. 1,3") from None


def _hybrid(args) -> tuple:
    """(dp, dp_replicate, dp_shard) from --dp, --dp-replicate and --dp-shard (None: not given)."""
    dp, rep, shard = args.dp, args.dp_replicate, args.dp_shard
    if rep is not None and shard is not None:
        if dp is not None and dp != rep * shard:
            raise InputError(f"--dp {dp} but --dp-replicate {rep} × --dp-shard {shard} = {rep * shard}: give two of "
                             f"them, or three that agree")
        dp = rep * shard
    return dp, rep, shard


def _layout(args, world) -> Layout:
    microbatches = args.microbatches
    dp, rep, shard = _hybrid(args)
    kw = dict(dp=dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero, schedule=args.schedule,
              virtual_stages=args.virtual_stages, sequence_parallel=args.sp, micro_batch_size=args.micro_batch_size,
              stage_layers=_stage_layers(args.stage_layers), cp_impl=args.cp_impl, cp_balance=args.cp_balance,
              ac=args.ac)
    layout = Layout.from_counts(world=world, microbatches=microbatches or 1, **kw)
    if shard is not None and rep is None:
        if layout.dp % shard:
            raise InputError(f"--dp-shard {shard} does not divide dp={layout.dp}; it could be one of "
                             f"{[d for d in range(1, layout.dp + 1) if layout.dp % d == 0]}")
        rep = layout.dp // shard
    if rep is not None:
        kw["dp_replicate"] = rep
        layout = Layout.from_counts(world=world, microbatches=microbatches or 1, **kw)
    gb = getattr(args, "global_batch", None)
    if gb is not None:
        per = layout.dp * layout.micro_batch_size
        if gb % per:
            raise InputError(f"--global-batch-size {gb} is not divisible by dp × micro-batch size = {layout.dp} × "
                             f"{layout.micro_batch_size} = {per}")
        if microbatches is not None and microbatches != gb // per:
            raise InputError(f"--global-batch-size {gb} means {gb // per} microbatches of dp × micro-batch size = "
                             f"{per} sequences, and --microbatches {microbatches} was given: give one")
        layout = Layout.from_counts(world=world, microbatches=gb // per, **kw)
    return layout


# -- the run ------------------------------------------------------------------------------------
def run_config(args, typed: set):
    """The RunConfig of `args` (train, check or plan), every input that needs no tensor
    checked (raises InputError, LayoutError or ValueError naming it)."""
    from .capacity import check_simulated_memory
    from .run_config import RunConfig

    verb, meta = args.verb, args.verb == "plan"
    backend = getattr(args, "backend", "sim")
    world = args.world
    if backend == "torch" and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        raise InputError("--backend torch runs one rank of a torchrun job, and RANK/WORLD_SIZE are not set: start it "
                         "as `torchrun --nproc_per_node N -m playground ...`, or use --backend gloo for local processes")
    if world is None and backend == "torch":
        world = int(os.environ["WORLD_SIZE"])  # under torchrun the world is its process count
    layout = _layout(args, world)
    cfg = _model(args, typed)
    _needs(typed, args, layout, cfg)
    layout.validate(cfg)
    hardware = getattr(args, "hardware", None)
    if hardware:
        from simulator.hardware import load_hardware
        load_hardware(hardware)  # an unknown or malformed profile fails here, before any work
    if getattr(args, "trace", None) and not hardware:
        raise InputError("--trace needs --hardware: without a profile there is no simulated time to draw")
    _outputs(args)
    dtype = args.dtype or DEFAULT_DTYPE[verb]
    for flag in ("--autocast", "--bf16-copies"):
        if getattr(args, flag[2:].replace("-", "_"), False) and dtype != "bfloat16":
            raise InputError(f"{flag} is a recipe of --dtype bfloat16, not of --dtype {dtype}")
    if getattr(args, "autocast", False) and layout.zero:
        raise InputError(f"--autocast with --zero {layout.zero}: ZeRO computes in its own bf16 compute copies of fp32 "
                         f"masters; give one of them")
    from model.config import DEFAULT_LR
    lr = getattr(args, "lr", None)
    if getattr(args, "resume", None) == "auto":
        if not getattr(args, "save", None):
            raise InputError("--resume auto resumes from --save DIR's checkpoint: give --save DIR")
        # a complete checkpoint is one whose index was written (checkpoint.has_checkpoint; the
        # index is renamed into place last); none yet: a fresh start
        args.resume = args.save if os.path.exists(os.path.join(args.save, "index.json")) else None
    run = RunConfig(model=cfg, layout=layout, steps=getattr(args, "steps", None) or DEFAULT_STEPS.get(verb, 3),
                    lr=lr if lr is not None else DEFAULT_LR[args.model], dtype=args.dtype or DEFAULT_DTYPE[verb],
                    reduce_dtype=args.reduce_dtype, grad_dtype=getattr(args, "grad_dtype", None),
                    seed=getattr(args, "seed", 0), data=getattr(args, "data", None),
                    bucket_cap_mb=args.bucket_mb, grad_overlap=not args.no_grad_overlap, backend=backend,
                    progress=not getattr(args, "no_progress", verb == "check"), hardware=hardware,
                    count_every_step=getattr(args, "count_every_step", False), save=getattr(args, "save", None),
                    save_every=getattr(args, "save_every", None), resume=getattr(args, "resume", None),
                    init_from=getattr(args, "init_from", None), compile=getattr(args, "compile", False),
                    cuda_graphs=getattr(args, "cuda_graphs", False),
                    # bf16 as compute copies unless --autocast (a plan prices copies: playground/planning.py)
                    bf16_copies=not getattr(args, "autocast", False),
                    faults=_faults(args, backend),
                    on_nan=getattr(args, "on_nan", "stop"), timeout=getattr(args, "timeout", None),
                    max_restarts=getattr(args, "max_restarts", 0), elastic=getattr(args, "elastic", None))
    _exist(args)
    if run.backend == "sim" and not meta:  # (a plan's ranks hold meta tensors: no memory)
        check_simulated_memory(run)
    return run


def _faults(args, backend: str) -> tuple:
    """The injected faults of this launch. A crash or a hang happens once: under torchrun, a
    job torchrun restarted (its TORCHELASTIC_RESTART_COUNT above 0) meets none of them again."""
    faults = tuple(getattr(args, "inject", ()))
    if backend == "torch" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        faults = tuple(f for f in faults if f.kind not in ("crash", "hang"))
    return faults


def check_files(args, run) -> None:
    """The second pass, which reads files with NumPy and torch: the data source, the
    checkpoint to resume from or to save over, the state_dict to start from."""
    from .data import make_source
    if args.verb != "plan":
        make_source(run.data, run.model.vocab_size, run.seed, run.model.seq_len)  # a bad data file fails here
    from .checkpoint import CheckpointError, has_checkpoint, read_index, resume_point
    if run.resume:
        index = read_index(run.resume, run.model)
        resume_point(index, run.resume, run)
        passed = [f for f in run.faults if f.kind != "slow" and f.step <= index["step"]]  # (slow lasts from its step on)
        if passed:
            raise ValueError(f"--inject {passed[0]}: step {passed[0].step} is not after the checkpoint's step "
                             f"{index['step']} that --resume continues from; it would never fire")
    if run.save:
        same = run.resume and os.path.abspath(run.resume) == os.path.abspath(run.save)
        if has_checkpoint(run.save) and not args.overwrite and not same:
            step = read_index(run.save)["step"]
            raise CheckpointError(f"--save {run.save}: holds a checkpoint (step {step}); add --overwrite to replace "
                                  f"it, or choose another folder")
    if run.init_from:
        _check_state_dict(run.init_from, run.model)


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
