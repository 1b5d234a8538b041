"""The `playground` command: train, check, plan, calibrate, export, bench (docs/architecture.md,
"One training step" and "The front door"; README for the tour).

Everything the command is given is checked before any rank starts (flags.py types and
bounds each value, inputs.py the combination: the layout, the model, the outputs, the data
file, the memory and time a simulated world needs, the backend), and a problem is one line
on stderr naming the values, with exit status 2. Ctrl-C stops the command at any moment,
even while torch is being imported, with one line and status 130. Heavy modules (torch)
are imported only once the arguments have passed the checks that need no tensor, so
`--help` and a bad flag answer at once.
"""
from __future__ import annotations

import ast
import os
import runpy
import sys
import threading

from .flags import given, parse
from .interrupts import by_interrupt, interrupts_never_ignored

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


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


def _export(args) -> int:
    from .inputs import InputError, writable
    try:
        if os.path.exists(args.file) and not args.overwrite:
            raise InputError(f"{args.file}: exists; add --overwrite to replace it")
        if not os.path.isdir(args.directory):
            raise InputError(f"{args.directory}: no such checkpoint folder")
        writable("", args.file)  # (before torch is imported and the checkpoint read)
        import torch

        from .checkpoint import CheckpointError, export
        try:
            state = export(args.directory)
        except CheckpointError as e:
            raise InputError(str(e)) from None
    except InputError as e:
        print(f"playground export: {e}", file=sys.stderr)
        return 2
    tmp = args.file + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(args.file)), exist_ok=True)  # (as --json and --save make theirs)
    torch.save(state, tmp)
    os.replace(tmp, args.file)
    n = sum(t.numel() for t in state.values())
    print(f"playground export: {args.file}: {len(state)} tensors, {n:,} parameters (the reference GPT's state_dict)")
    return 0


def _is_rank0(backend: str) -> bool:
    return backend != "torch" or int(os.environ.get("RANK", "0")) == 0


def _interrupted(verb: str) -> int:
    """Ctrl-C: one line and status 130."""
    print(f"\n{verb}: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if any(m == "torch" or m.startswith("torch.") for m in sys.modules) or any(
            t.name.startswith("sim-rank-") and t.is_alive() for t in threading.enumerate()):
        # simulated ranks may be inside torch ops, or torch half imported (a failed import
        # leaves its submodules behind, not "torch"): leave at once, without the
        # interpreter's teardown (which would wait on them, or die in torch's)
        os._exit(130)
    return 130


def main(argv=None) -> int:
    verb, code = "playground", 1
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = parse(argv)
        verb = f"playground {args.verb}"
        with interrupts_never_ignored(lambda: verb):  # (importing torch, for one)
            code = _main(args, given(argv))
        return code
    except Exception as e:  # noqa: BLE001
        if by_interrupt(e):  # (Ctrl-C while a class was being defined: playground/interrupts.py)
            return _interrupted(verb)
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            raise  # (a bug: its traceback)
        # under torchrun, this rank's own failure (an injected crash, a peer gone from a
        # collective): one line, then leave at once, since its peers may wait in a collective
        print(f"{verb}: rank {dist.get_rank()} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return _interrupted(verb)
    finally:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and getattr(dist, "is_initialized", None) and dist.is_available() and dist.is_initialized():
            import torch  # torchrun: leave NCCL/gloo cleanly
            if code == 0:  # (after a failure the others may be inside a collective: no barrier to meet them in)
                cuda = dist.get_backend() == "nccl"
                dist.barrier(device_ids=[torch.cuda.current_device()] if cuda else None)
            dist.destroy_process_group()
            if code != 0:  # leave now: the rank's peers may still wait in a collective (torchrun restarts the job)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)


def _main(args, typed: set) -> int:
    if args.verb == "bench":
        return _bench(args)
    if args.verb == "export":
        return _export(args)
    if args.verb == "calibrate":
        return _calibrate(args)
    from .inputs import InputError, check_files, run_config
    from .layout import LayoutError
    try:
        if args.verb == "plan" and args.search:
            return _search(args, typed)
        run = run_config(args, typed)  # (no torch yet)
        _announce(args, run)
        check_files(args, run)
        if args.verb == "check":
            from .equivalence import checkable
            checkable(run)
    except (InputError, LayoutError, ValueError, FileNotFoundError) as e:  # data, checkpoint, hardware errors too
        print(f"playground {args.verb}: {e}", file=sys.stderr)
        return 2
    from collectives import CollectiveError, RankFailedError
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


LONG_RUN_S = 600  # a run estimated to take longer is announced with its estimate


def _announce(args, run) -> None:
    """One line on stderr before a run that will take long on this machine, or a plan
    whose model states alone cannot fit (capacity.py)."""
    if args.verb == "plan":
        from simulator.hardware import load_hardware

        from collectives.ledger import human_bytes

        from .search import model_states_bound
        hw = load_hardware(run.hardware)
        states = model_states_bound(run.model, run.layout)
        if states > hw.hbm_capacity:
            print(f"playground plan: model states alone take {human_bytes(states)} per rank, over {hw.name}'s "
                  f"{human_bytes(hw.hbm_capacity)} of HBM by {human_bytes(states - hw.hbm_capacity)}: this layout "
                  f"cannot fit; planning its step anyway", file=sys.stderr, flush=True)
        return
    if run.backend != "sim":
        return
    from .capacity import duration, estimated_seconds
    steps = run.steps
    seconds = estimated_seconds(run, steps, passes=2 if args.verb == "check" else 1)
    if seconds > LONG_RUN_S:
        print(f"playground {args.verb}: {run.model.flops_per_token() * run.tokens_per_step:.2g} model FLOPs a step: "
              f"at least {duration(seconds)} for {steps} steps on this machine (an estimate from its matmul rate; "
              f"Ctrl-C stops it, fewer --steps or a shorter --seq-len shorten it)", file=sys.stderr, flush=True)


def _calibrate(args) -> int:
    from .inputs import InputError, writable
    if args.backend == "gloo" and not args.world:
        print("playground calibrate: --backend gloo needs --world N (the processes to start)", file=sys.stderr)
        return 2
    if args.backend == "torch" and "RANK" not in os.environ:
        print("playground calibrate: --backend torch runs under torchrun (torchrun --nproc_per_node N -m playground "
              "calibrate ...); or use --backend gloo --world N", file=sys.stderr)
        return 2
    if args.backend == "torch" and args.world is not None:
        print("playground calibrate: --world is torchrun's process count with --backend torch: leave it out",
              file=sys.stderr)
        return 2
    name = args.name or os.path.splitext(os.path.basename(args.out))[0]
    from simulator.hardware import load_hardware
    try:
        load_hardware(args.base)  # an unknown --base, before minutes of measuring
        if _is_rank0(args.backend):
            writable("--out", args.out)  # and the file it will write
    except (ValueError, InputError) as e:
        print(f"playground calibrate: {e if isinstance(e, InputError) else f'--base: {e}'}", file=sys.stderr)
        return 2
    from model.config import preset

    from .calibrate import MeasurementError, calibrate, summary, write_profile
    try:
        hw, record = calibrate(args.backend, args.world, preset(args.model), args.micro_batch_size, args.base,
                               args.max_mib, name)
    except MeasurementError as e:
        print(f"playground calibrate: {e}", file=sys.stderr)
        return 1
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
    from .planning import failures_summary, plan, plan_json, summary
    p = plan(run)
    print(summary(p, args.memory_headroom))
    print(failures_summary(p, args.checkpoint_gbps, args.mtbf_hours, args.restart_seconds))

    def plots(directory):
        from .plots import write_plan_plots
        return write_plan_plots(p, directory, args.memory_headroom)
    _write_outputs(args, lambda path: _trace(path, p.ledger, p.clocks, p.ran), plots, lambda: plan_json(p, args.memory_headroom))
    return 0


def _search(args, typed: set) -> int:
    from .inputs import InputError, run_config
    from .search import search, search_summary
    if args.world is None or args.global_batch is None:
        raise InputError("--search: give --world N and --global-batch-size B (the layouts are what it finds)")
    given_ = [f for f in ("--json", "--plots", "--trace", "--microbatches", "--dp") if f in typed]
    if given_:
        raise InputError(f"--search: {', '.join(given_)} describe one layout: plan the layout the search found")
    fixed = {"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep}
    global_batch = args.global_batch
    args.dp = args.tp = args.pp = args.cp = args.ep = args.global_batch = None  # the template's layout: dp = world
    run = run_config(args, typed)
    res = search(run, args.world, global_batch, fixed, exact=args.exact, headroom=args.memory_headroom, jobs=args.jobs)
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
