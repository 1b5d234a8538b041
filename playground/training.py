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
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from collectives import launch
from model.dropout import seed_dropout
from simulator import SimulatedTime

from . import checkpoint
from .data import make_source
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


def _skipped(model) -> int:
    """Steps the fp16 loss scalers skipped so far (an overflow)."""
    return sum(s.skipped for s in getattr(model.optimizer, "scalers", []))


def train_rank(world, run: RunConfig, collect: bool = False, source=None, init=None) -> dict:
    """One rank's program. With `collect`, also returns the pieces (Placement, CPU float64
    copy) of the state before the first step ("initial": weights and AdamW's moments) and
    of each step's gradients and the state after it ("steps"; `TrainResult.pieces`).
    `source`: the data source, built once by the driver and shared (read only) by the
    simulated ranks; built here when None (gloo and torch processes). `init`: the reference
    GPT's state_dict to start from (--init-from). With `run.resume` the steps continue from
    the checkpoint's (any layout) up to `run.steps`, the run's total (as Megatron-LM's
    --train-iters): relaunching the same command after a crash finishes the same run. With
    `run.save` checkpoints are written, at every `save_every`-th step and at the last."""
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
        out_states = {"initial": _state(model), "steps": []}
    source = source or make_source(run.data, cfg.vocab_size, run.seed)
    out = {"losses": [], "step_times": [], "host_blocked": [], "sim_steps": [], "memory": None, "moe": [], "start": start}
    timing = world.timing if run.hardware else None  # the simulator's clock and compute model
    clock = timing.clock if timing else None
    bar = _progress_bar(run.steps, start) if run.progress and world.rank == 0 else None
    # on a GPU with no progress bar to show it, each step's loss is read after the run: reading
    # it (and waiting for its average) at every step would stall the host until the device is idle
    deferred = device.startswith("cuda") and bar is None and not run.save
    losses = []
    prefetch = Prefetch(source, layout.global_batch, cfg.seq_len, rank.rows, device, start, run.steps) \
        if device.startswith("cuda") else None
    for i, step in enumerate(range(start, run.steps)):  # (the data is a function of the step)
        t0, blocked0 = time.perf_counter(), world.host_blocked()
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
            total = rank.forward_backward(rank.microbatches(local), track)
            if collect:
                grads, skipped = model.pieces("grad"), _skipped(model)
            rank.update()
            if collect:
                out_states["steps"].append({"grads": grads, "state": _state(model),
                                            "skipped": _skipped(model) > skipped})
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
        out["step_times"].append(time.perf_counter() - t0)
        out["host_blocked"].append(world.host_blocked() - blocked0)
        if run.save and ((step + 1) % (run.save_every or run.steps) == 0 or step == run.steps - 1):
            written = checkpoint.save(world, model, run.save, step + 1, checkpoint.metadata(run, model))
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
    for work, total in losses:
        work.wait()
        out["losses"].append(total.item())
    out["moe"] = [{i: st if isinstance(st, dict) else st.as_dict() for i, st in step.items()} for step in out["moe"]]
    if device.startswith("cuda"):  # to hold the accounting against what the allocator saw
        out["cuda_peak_allocated"] = torch.cuda.max_memory_allocated()
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
    step_times: list  # rank 0's wall time per step
    wall_s: float  # the whole launch
    ledger: object
    loss_floor: float | None
    data: str
    values: list  # every rank's output
    clocks: list | None = None  # every rank's simulated clock (with --hardware)

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
    def tokens_per_s(self) -> float:
        """Global tokens per second of wall time, median step."""
        ts = sorted(self.step_times)
        return self.run.tokens_per_step / ts[len(ts) // 2]


def train(run: RunConfig, collect: bool = False) -> TrainResult:
    """Train `run` (from its checkpoint to `run.steps` with --resume) on its backend."""
    run.layout.validate(run.model)
    if run.resume:
        _, note = checkpoint.resume_point(checkpoint.read_index(run.resume, run.model), run.resume, run)
        if note:
            print(f"playground: {note}", file=sys.stderr)
    if run.hardware and run.model.n_experts and not run.count_every_step:
        # token counts change from step to step: a recorded step's compute cannot be replayed
        print("playground: experts route different token counts every step, so every step's ops are counted "
              "(no replay of step 2)", file=sys.stderr)
        run = replace(run, count_every_step=True)
    source = make_source(run.data, run.model.vocab_size, run.seed)
    init = torch.load(run.init_from, map_location="cpu", weights_only=True) if run.init_from and run.backend == "sim" \
        else None  # (processes load it themselves)
    t0 = time.perf_counter()
    if run.backend == "torch":  # this process is one rank: it uses the source it just built
        res = launch(train_rank, run.layout.world, backend="torch", args=(run, collect, source, None))
    else:
        shared = SharedBatches(source) if run.backend == "sim" else None  # processes build their own
        extra = {"max_running": run.max_running or 2 * (os.cpu_count() or 1),
                 "time_model": SimulatedTime(run.hardware) if run.hardware else None} if run.backend == "sim" else {}
        res = launch(train_rank, run.layout.world, backend=run.backend, args=(run, collect, shared, init),
                     **extra)
    wall = time.perf_counter() - t0
    return TrainResult(run, res.values[0]["losses"], res.values[0]["step_times"], wall, res.ledger,
                       source.loss_floor, source.describe(), res.values,
                       res.time_model.clocks if res.time_model else None)
