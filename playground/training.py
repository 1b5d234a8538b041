"""The training loop: one rank's program (`train_rank`) and the driver (`train`).

Per step: every rank draws the same global batch, takes its data-parallel rows, splits
them into microbatches of `micro_batch_size` sequences, runs forward/backward on each
(gradient accumulation under DDP's `no_sync`, the last one synchronises), then AdamW.
The loss reported is the mean over all tokens of the global batch (each rank's mean,
averaged over the DP group: one small all-reduce labelled `metrics.loss`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from collectives import CollectiveTimeoutError, RankFailedError, launch
from model.dropout import seed_dropout
from model.region_timer import region_timer
from simulator import SimulatedTime

from . import checkpoint
from .data import make_source
from .device_steps import DeviceSteps
from .faults import LaggedCheck, NonFiniteError, RankFaults
from .rank_program import RankProgram
from .run_config import RunConfig


class SharedBatches:
    """A data source shared by the simulated ranks of one process: the global batch of
    a step is drawn once and handed to every rank (each takes its rows, read only)."""

    def __init__(self, source):
        self.source = source
        self.lock = threading.Lock()
        self.key = self.batch = None

    def global_batch(self, step: int, n: int, seq_len: int):
        with self.lock:
            if self.key != (step, n, seq_len):
                self.key, self.batch = (step, n, seq_len), self.source.global_batch(step, n, seq_len)
            return self.batch


class _Rows(torch.utils.data.IterableDataset):
    """(step, this rank's rows of the step's global batch) for the steps in [start, stop)."""

    def __init__(self, source, n: int, seq_len: int, rows: slice, start: int, stop: int):
        super().__init__()
        self.source, self.n, self.seq_len, self.rows, self.start, self.stop = source, n, seq_len, rows, start, stop

    def __iter__(self):
        for step in range(self.start, self.stop):
            yield step, self.source.global_batch(step, self.n, self.seq_len)[self.rows]


class Prefetch:
    """On a GPU: this rank's rows of the coming steps' batches are made by a DataLoader worker
    process while the device runs this step, pinned, and copied without blocking the host.
    Making a batch is host work in Python (the synthetic source walks its chain token by
    token); on a thread of this process it held the GIL against the thread that issues the
    kernels, and a host-bound step lost that time. A process of its own takes it off this
    one's interpreter, as a DataLoader worker does for any torch training loop (README,
    "Performance", gives the measurements)."""

    def __init__(self, source, n: int, seq_len: int, rows: slice, device: str, start: int, stop: int):
        loader = torch.utils.data.DataLoader(_Rows(source, n, seq_len, rows, start, stop), batch_size=None,
                                             num_workers=1, prefetch_factor=2, pin_memory=device.startswith("cuda"))
        self.batches, self.device = iter(loader), device
        self.held = None  # the pinned batch of the copy in flight (kept alive until it is done)

    def batch(self, step: int) -> torch.Tensor:
        made, self.held = next(self.batches)
        if made != step:
            raise RuntimeError(f"prefetch: the worker made step {made}'s batch where step {step}'s was wanted")
        return self.held.to(self.device, non_blocking=True)

    def close(self) -> None:
        """Stop the worker (also when the run ends early): the DataLoader's iterator shuts its
        workers down when it is dropped."""
        self.batches = None


def _device(run: RunConfig) -> str:
    if run.backend == "torch" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _progress_bar(steps: int, start: int = 0):
    """Rank 0's progress bar (from `start`, a resumed run's first step, to `steps`). One
    process writes it, so tqdm gets a thread lock: its default multiprocessing lock would be
    left behind (and reported by multiprocessing's resource tracker) when a gloo rank
    process is stopped."""
    tqdm.set_lock(threading.RLock())
    return tqdm(total=steps, initial=start, desc="train", unit="step", dynamic_ncols=True)


def _state(model) -> list:
    """[(kind, Placement, CPU float64 copy)] of this rank's weights and AdamW moments."""
    return [(kind, pl, t.detach().to("cpu", torch.float64).clone()) for kind, pl, t in model.state_pieces()]


def _loss_scale(model) -> float | None:
    """The fp16 loss scale this step's backward ran at (every scaler holds the same), or None."""
    scalers = getattr(model.optimizer, "scalers", [])
    return scalers[0].scale if scalers else None


def _skipped(model) -> int:
    """Steps the fp16 loss scalers skipped so far (an overflow)."""
    return sum(s.skipped for s in getattr(model.optimizer, "scalers", []))


def _lags(run: RunConfig, deferred: bool) -> bool:
    """Whether the NaN check is read a step late (faults.LaggedCheck): where the losses are
    (`deferred`: a GPU, no progress bar, no checkpoints), unless it is off or fp16's."""
    return deferred and run.on_nan != "off" and run.dtype != "float16"


def _skipped_step(out: dict, step: int, found: str, world, bar) -> None:
    """--on-nan skip: `step` was skipped for `found`, on every rank alike; rank 0 says so."""
    out["skipped_steps"].append(step)
    if world.rank == 0:
        (bar.write if bar is not None else print)(f"playground: step {step} skipped: {found}", file=sys.stderr)


def train_rank(world, run: RunConfig, collect: bool = False, source=None, init=None, progress=None) -> dict:
    """One rank's program. With `collect`, also returns the pieces (Placement, CPU float64
    copy) of the state before the first step ("initial": weights and AdamW's moments) and
    of each step's gradients and the state after it ("steps"; `TrainResult.pieces`).
    `source`: the data source, built once by the driver and shared (read only) by the
    simulated ranks; built here when None (gloo and torch processes). `init`: the reference
    GPT's state_dict to start from (--init-from). With `run.resume` the steps continue from
    the checkpoint's (any layout) up to `run.steps`, the run's total (as Megatron-LM's
    --train-iters): relaunching the same command after a crash finishes the same run. With
    `run.save` checkpoints are written, at every `save_every`-th step and at the last.
    `progress` (simulated ranks: an object the driver reads after a failure): rank 0 notes
    there when each step ended and when the last checkpoint was saved (wall clock, and
    simulated time with a profile), what a restart's report charges to the fault."""
    layout, cfg = run.layout, run.model
    device = _device(run)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if init is None and run.init_from:
        init = torch.load(run.init_from, map_location="cpu", weights_only=True)
    rank = RankProgram(world, run, device, state_dict=init)
    model, mesh = rank.model, rank.mesh
    if collect:  # the check's reference replays the routing decisions made here at near-ties
        for layer in model.moe_layers:
            layer.record = True
    start = checkpoint.load(model, run.resume, checkpoint.read_index(run.resume, cfg)) if run.resume else 0
    if collect:  # the state every step starts from, for the check's reference to take each step from it
        out_states = {"initial": _state(model), "initial_updates": model.steps_taken(), "steps": []}
    source = source or make_source(run.data, cfg.vocab_size, run.seed)
    out = {"losses": [], "step_times": [], "host_blocked": [], "sim_steps": [], "memory": None, "moe": [], "start": start,
           "skipped_steps": [], "overflow_steps": [], "loss_scale": _loss_scale(model)}
    faults = RankFaults(run.faults, world.rank)
    timing = world.timing if run.hardware else None  # the simulator's clock and compute model
    clock = timing.clock if timing else None
    bar = _progress_bar(run.steps, start) if run.progress and world.rank == 0 else None
    # on a GPU with no progress bar to show it, each step's loss is read after the run: reading
    # it (and waiting for its average) at every step would stall the host until the device is idle
    deferred = device.startswith("cuda") and bar is None and not run.save
    # so too the NaN check: read a step late, each step's update skipped on the device where it
    # found one (faults.LaggedCheck); fp16's loss scaler reads its own overflow at once
    lagged = LaggedCheck() if _lags(run, deferred) and not collect else None
    losses = []
    prefetch = Prefetch(source, layout.global_batch, cfg.seq_len, rank.rows, device, start, run.steps) \
        if device.startswith("cuda") else None
    device_steps = DeviceSteps() if device.startswith("cuda") else None  # each step's time on the device
    regions = region_timer()  # the host's time in compiled regions, where calibrate times it
    if regions is not None:
        out["region_host"] = []
    for i, step in enumerate(range(start, run.steps)):  # (the data is a function of the step)
        faults.before_step(world, step + 1)  # (an injected crash raises, a hang stops answering)
        if timing:
            timing.compute_model.slowdown = faults.slowdown(step + 1)
        t0, blocked0 = time.perf_counter(), world.host_blocked()
        in_regions0 = regions.seconds if regions is not None else 0.0
        if device_steps is not None:
            device_steps.started()
        replay = None if run.count_every_step else ("record" if i == 1 else "replay" if i > 1 else None)
        counted = timing.compute_model.step(replay) if timing else contextlib.nullcontext()
        # "train.step" (outside the op counting, which would count its profiler op): where a
        # torch profiler's steady state is cut (benchmarks/gpu_profile.py)
        with torch.profiler.record_function("train.step"), counted:  # counting: on, recorded or replayed
            sim0 = clock.breakdown() if clock else None
            if cfg.attention_dropout:  # the masks are a function of the step, as the data is
                for part in model.parts:
                    seed_dropout(part, run.seed, mesh.rank, step)
            if prefetch is not None:
                local = prefetch.batch(step)
            else:
                local = rank.local(source.global_batch(step, layout.global_batch, cfg.seq_len)).to(device)
            # activations are tracked (every tensor autograd saves hooked) only with simulated
            # time; a replayed step's are the recorded one's
            track = rank.track if run.hardware and replay != "replay" else contextlib.nullcontext
            t_work = time.perf_counter()
            total = rank.forward_backward(rank.microbatches(local), track)
            if not timing:  # (on simulated time the compute model slows the rank's kernels)
                faults.straggle(step + 1, time.perf_counter() - t_work)
            faults.corrupt(model, step + 1)
            t_check = time.perf_counter()
            if lagged is not None:  # this step's check started, the last step's read
                found_inf = rank.nonfinite_lagged(lagged, step + 1, total)
                found_step, found = lagged.read(world)
            else:  # (on a GPU its read of the flags waits for the device)
                found_inf, found_step, found = None, step + 1, rank.nonfinite(total)
            checked = time.perf_counter() - t_check if device.startswith("cuda") else 0.0
            if found and run.on_nan == "stop":
                late = f"; its update and step {step + 1}'s were not made" if found_step != step + 1 else ""
                raise NonFiniteError(f"step {found_step}: {found}; stopped before the optimizer step{late} (--on-nan "
                                     f"skip skips such a step)")
            if collect:
                grads, skipped, scale = model.pieces("grad"), _skipped(model), _loss_scale(model)
            if found:  # --on-nan skip: every rank alike
                _skipped_step(out, found_step, found, world, bar)
            overflows = _skipped(model)
            if found and lagged is None:
                model.skip_step()
            else:
                rank.update(found_inf)
            if _skipped(model) > overflows:  # fp16: the loss scaler found an overflow and skipped the step
                out["overflow_steps"].append(step + 1)
            out["loss_scale"] = _loss_scale(model)
            if collect:
                out_states["steps"].append({"grads": grads, "state": _state(model), "loss_scale": scale,
                                            "skipped": bool(found) or _skipped(model) > skipped,
                                            "updates": model.steps_taken()})  # (AdamW's count)
            if cfg.n_experts:  # this rank's routing statistics of the step, per MoE layer it holds
                # (read after the run where the losses are: reading them now would stop the host)
                out["moe"].append({layer.index: layer.stats if deferred else layer.stats.as_dict()
                                   for layer in model.moe_layers})
            work = rank.average_loss(total, async_op=deferred)
            if step == run.steps - 1:  # model states after the last step; the peaks are the tracker's own
                out["memory"] = rank.memory_snapshot()
            if clock:
                sim1 = clock.breakdown()
                out["sim_steps"].append({k: sim1[k] - sim0[k] for k in sim1})
            if deferred:
                losses.append((work, total))
            else:
                out["losses"].append(total.item())
        if device_steps is not None:
            device_steps.ended()
        out["step_times"].append(time.perf_counter() - t0)
        out["host_blocked"].append(world.host_blocked() - blocked0 + checked)
        if regions is not None:
            out["region_host"].append(regions.seconds - in_regions0)
        if progress is not None and world.rank == 0:
            progress.step_ended(step + 1, clock.breakdown()["time"] if clock else None)
        if run.save and ((step + 1) % (run.save_every or run.steps) == 0 or step == run.steps - 1):
            written = checkpoint.save(world, model, run.save, step + 1, checkpoint.metadata(run, model))
            if progress is not None and world.rank == 0:
                progress.saved(step + 1)
            if world.rank == 0:  # one line per checkpoint, under the progress bar
                (bar.write if bar is not None else print)(f"checkpoint: step {step + 1} saved to {run.save} "
                                                          f"({written / 2**20:,.1f} MiB)", file=sys.stderr)
        if bar is not None:
            bar.set_postfix(loss=f"{out['losses'][-1]:.4f}", last_step_tok_s=f"{run.tokens_per_step / out['step_times'][-1]:,.0f}")
            bar.update()
    if bar is not None:
        bar.close()
    if prefetch is not None:
        prefetch.close()
    if lagged is not None:  # the last step's check
        found_step, found = lagged.read(world, earlier=False)
        if found and run.on_nan == "stop":
            raise NonFiniteError(f"step {found_step}: {found}; its update was not made (the run's last step)")
        if found:
            _skipped_step(out, found_step, found, world, bar)
    for work, total in losses:
        work.wait()
        out["losses"].append(total.item())
    if device_steps is not None:
        out["device_step_times"] = device_steps.seconds()
    out["moe"] = [{i: st if isinstance(st, dict) else st.as_dict() for i, st in step.items()} for step in out["moe"]]
    if device.startswith("cuda"):  # to hold the accounting against what the allocator saw
        out["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
        # what the caching allocator held at most (allocated, its cache and its fragments): what
        # a GPU shows in use, less the CUDA context and NCCL's own buffers
        out["cuda_peak_reserved"] = torch.cuda.max_memory_reserved()
    if collect:
        out.update(out_states)
        # the token groups this rank routes: its dp rank's microbatches of its cp rank's (and under
        # sequence parallelism its tp rank's) tokens (equivalence.token_groups)
        out["token_group"] = (rank.dp.rank, mesh.group("cp").rank, mesh.group("tp").rank if layout.sequence_parallel else 0)
    return out


@dataclass
class TrainResult:
    run: RunConfig
    losses: list
    step_times: list  # rank 0's host's wall time per step
    wall_s: float  # the whole launch
    ledger: object
    loss_floor: float | None
    data: str
    values: list  # every rank's output
    clocks: list | None = None  # every rank's simulated clock (with --hardware)
    restarts: list = field(default_factory=list)  # Restart: what each fault that stopped a launch cost

    def moe_steps(self) -> list:
        """Per step, per MoE layer: routing statistics summed over the ranks (pre-drop
        assignments per expert, assignments, dropped), the auxiliary and z losses averaged
        over the ranks that hold the layer, and with a balancing bias its value after the step
        ("bias", per expert)."""
        out = []
        for step in range(len(self.losses)):
            layers: dict = {}
            for v in self.values:
                for index, st in (v["moe"][step] if v.get("moe") else {}).items():
                    acc = layers.setdefault(index, {"routed": None, "assignments": 0, "dropped": 0, "aux": 0.0,
                                                    "z": 0.0, "ranks": 0})
                    acc["routed"] = st["routed"] if acc["routed"] is None else \
                        [a + b for a, b in zip(acc["routed"], st["routed"])]
                    for k in ("assignments", "dropped"):
                        acc[k] += st[k]
                    acc["aux"] += st["aux"]
                    acc["z"] += st["z"]
                    acc["ranks"] += 1
                    if st.get("bias") is not None:  # (the same on every rank holding the layer)
                        acc["bias"] = st["bias"]
            for acc in layers.values():
                acc["aux"] /= acc["ranks"]
                acc["z"] /= acc["ranks"]
            out.append(dict(sorted(layers.items())))
        return out

    def pieces(self, what: str, step: int | None = None) -> list:
        """With `collect`: every rank's [(Placement, tensor)] of `what` at `step` (a step of
        the whole run, one this run took; default its last): "grads", the step's reduced
        gradients; "param", "exp_avg" or "exp_avg_sq", the state after it. `model.assemble`
        makes the full tensors of them."""
        i = (len(self.losses) if step is None else step + 1 - self.start) - 1
        if what == "grads":
            return [v["steps"][i]["grads"] for v in self.values]
        return [[(pl, t) for kind, pl, t in v["steps"][i]["state"] if kind == what] for v in self.values]

    @property
    def start(self) -> int:
        """The step this run began at (after a checkpoint's, with --resume)."""
        return self.values[0].get("start", 0)

    @property
    def device_step_times(self) -> list | None:
        """Rank 0's time per step on its device (a GPU; playground/device_steps.py), else None."""
        return self.values[0].get("device_step_times")

    @property
    def tokens_per_s(self) -> float:
        """Global tokens per second, median step: the device's steps on a GPU (the host may
        run ahead of them), else the host's wall time."""
        ts = sorted(self.device_step_times or self.step_times)
        return self.run.tokens_per_step / ts[len(ts) // 2]


class Progress:
    """Rank 0's progress through one launch (simulated ranks): when each step ended and when
    the last checkpoint was written, for the cost of a fault."""

    def __init__(self, start: int, sim_start: float | None = None):
        self.start = time.perf_counter()
        self.step = start  # the last step finished
        self.sim = sim_start
        self.saved_at = (start, self.start, sim_start)  # (step, wall, simulated): where a restart resumes

    def step_ended(self, step: int, sim: float | None) -> None:
        self.step, self.sim = step, sim

    def saved(self, step: int) -> None:
        self.saved_at = (step, time.perf_counter(), self.sim)


@dataclass
class Restart:
    """What one fault cost (the report's faults table)."""
    fault: str  # the fault that fired ("crash@5:1"), or what failed
    detected: str  # how: the rank's error, or the timeout
    failed_step: int  # the step the run was in
    resumed_from: int  # the checkpoint's step the restart continued from
    wall_lost_s: float  # wall time from the checkpoint written to the failure found
    sim_lost_s: float | None  # simulated time of the steps recomputed
    layout: str | None = None  # the layout the restart continued on, where it shrank (--elastic)

    @property
    def steps_recomputed(self) -> int:
        return self.failed_step - 1 - self.resumed_from


def collective_timeout(run: RunConfig) -> float:
    """Seconds a rank may wait in one collective: --timeout, else NCCL's watchdog's 10 minutes on
    gloo and torch, and on simulated ranks a minute, or three of this run's estimated steps where
    longer (one rank's wait holds every other rank's compute on this machine's cores)."""
    if run.timeout:
        return run.timeout
    if run.backend != "sim":
        return 600.0
    from .capacity import estimated_seconds
    return max(60.0, 3 * estimated_seconds(run, 1) * run.layout.world)


def train(run: RunConfig, collect: bool = False) -> TrainResult:
    """Train `run` (from its checkpoint to `run.steps` with --resume) on its backend; after a
    crash or a hang, up to `run.max_restarts` times again from the last checkpoint of
    `run.save` (the TrainResult's `restarts` say what each cost)."""
    restarts, faults = [], list(run.faults)
    t0 = time.perf_counter()
    while True:
        attempt = replace(run, faults=tuple(faults))
        progress = Progress(attempt_start(attempt), 0.0 if run.hardware else None) if run.backend == "sim" else None
        try:
            res = _train_once(attempt, collect, progress)
            break
        except (RankFailedError, CollectiveTimeoutError) as e:
            if len(restarts) >= run.max_restarts:
                raise
            failed = time.perf_counter()
            start = attempt_start(attempt)
            pending = sorted((f for f in faults if f.kind in ("crash", "hang") and f.step > start),
                             key=lambda f: (f.step, f.rank))
            fired = pending[0] if pending else None
            shrunk = None
            if fired is not None and fired.permanent:
                if run.elastic is None:
                    raise RankFailedError(fired.rank, f"rank {fired.rank} is lost for good ({fired}): a restart onto "
                                                      f"the same {run.layout.world} ranks cannot continue the run (--elastic "
                                                      f"MIN lets it continue on fewer)") from e
                shrunk = elastic_layout(run, fired)
            resumed = checkpoint.read_index(run.save)["step"] if checkpoint.has_checkpoint(run.save) else 0
            step = fired.step if fired else (progress.step + 1 if progress else resumed + 1)
            wall_lost, sim_lost = (failed - progress.saved_at[1], None) if progress else (failed - t0, None)
            if progress is not None and progress.sim is not None and progress.saved_at[2] is not None:
                sim_lost = progress.sim - progress.saved_at[2]
            how = (f"the others' collective timeout ({collective_timeout(attempt):g} s)"
                   if isinstance(e, CollectiveTimeoutError) else
                   f"rank {e.rank} raised {type(e.__cause__).__name__ if e.__cause__ else 'an error'}")
            restarts.append(Restart(str(fired) if fired else type(e).__name__, how, step, resumed, wall_lost, sim_lost,
                                    shrunk.describe() if shrunk else None))
            if fired is not None:
                faults.remove(fired)
            print(f"playground: {restarts[-1].fault} at step {step} ({how}); restart {len(restarts)} of "
                  f"{run.max_restarts} from " + (f"the checkpoint at step {resumed}" if resumed else "the start")
                  + (f" on {shrunk.describe()}" if shrunk else ""), file=sys.stderr)
            if shrunk is not None:  # the faults of ranks that are no more go with them
                faults = [f for f in faults if f.rank < shrunk.world]
                run = replace(run, layout=shrunk, faults=tuple(faults))
            run = replace(run, resume=run.save if resumed else None)
    res.restarts = restarts
    res.wall_s = time.perf_counter() - t0
    return res


def elastic_layout(run: RunConfig, lost):
    """The layout a restart continues on without the rank `lost` (a Fault): one data-parallel
    replica fewer (every rank of the lost one's replica goes: its model-parallel peers hold
    nothing the others lack), the global batch kept by more microbatches; RankFailedError
    naming the numbers when that cannot be (fewer than --elastic ranks, a batch that does not
    split, a layout that does not validate)."""
    from dataclasses import replace as with_
    layout = run.layout
    per_replica = layout.world // layout.dp
    dp = layout.dp - 1
    fail = f"rank {lost.rank} is lost for good ({lost}): "
    if layout.dp_replicate > 1:
        raise RankFailedError(lost.rank, fail + "shrinking a hybrid-sharded layout is not built")
    if dp < 1 or dp * per_replica < run.elastic:
        raise RankFailedError(lost.rank, fail + f"without its replica {dp * per_replica} ranks are left, fewer than "
                                                f"--elastic {run.elastic}")
    batch, mbs = layout.global_batch, layout.micro_batch_size
    if batch % (dp * mbs):
        raise RankFailedError(lost.rank, fail + f"the global batch of {batch} sequences does not split over dp {dp} × "
                                                f"micro-batch {mbs}: no layout of {dp * per_replica} ranks keeps it")
    shrunk = with_(layout, dp=dp, microbatches=batch // (dp * mbs))
    try:
        shrunk.validate(run.model)
    except ValueError as e:
        raise RankFailedError(lost.rank, fail + f"the layout without its replica does not hold: {e}") from None
    return shrunk


def attempt_start(run: RunConfig) -> int:
    """The step a launch of `run` starts from (its checkpoint's, with --resume)."""
    return checkpoint.read_index(run.resume)["step"] if run.resume else 0


def _train_once(run: RunConfig, collect: bool = False, progress=None) -> TrainResult:
    """One launch of `run`."""
    run.layout.validate(run.model)
    if run.resume:
        _, note = checkpoint.resume_point(checkpoint.read_index(run.resume, run.model), run.resume, run)
        if note:
            print(f"playground: {note}", file=sys.stderr)
    if run.hardware and any(f.kind == "slow" for f in run.faults) and not run.count_every_step:
        run = replace(run, count_every_step=True)  # (a slow rank's later steps differ from the recorded one)
    if run.hardware and run.model.n_experts and not run.count_every_step:
        # token counts change from step to step: a recorded step's compute cannot be replayed
        print("playground: experts route different token counts every step, so every step's ops are counted "
              "(no replay of step 2)", file=sys.stderr)
        run = replace(run, count_every_step=True)
    source = make_source(run.data, run.model.vocab_size, run.seed)
    init = torch.load(run.init_from, map_location="cpu", weights_only=True) if run.init_from and run.backend == "sim" \
        else None  # (processes load it themselves)
    t0 = time.perf_counter()
    timeout = collective_timeout(run)
    if run.backend == "torch":  # this process is one rank: it uses the source it just built
        res = launch(train_rank, run.layout.world, backend="torch", args=(run, collect, source, None), timeout=timeout)
    else:
        shared = SharedBatches(source) if run.backend == "sim" else None  # processes build their own
        extra = {"max_running": run.max_running or 2 * (os.cpu_count() or 1),
                 "time_model": SimulatedTime(run.hardware) if run.hardware else None} if run.backend == "sim" else {}
        res = launch(train_rank, run.layout.world, backend=run.backend,
                     args=(run, collect, shared, init) + ((progress,) if run.backend == "sim" else ()),
                     timeout=timeout, **extra)
    wall = time.perf_counter() - t0
    return TrainResult(run, res.values[0]["losses"], res.values[0]["step_times"], wall, res.ledger,
                       source.loss_floor, source.describe(), res.values,
                       res.time_model.clocks if res.time_model else None)
