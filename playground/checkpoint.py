"""Checkpoints: every rank writes the pieces it holds, each with its placement; any layout
loads any other (docs/architecture.md, "Checkpoints").

Format (version 1), in a folder:

    index.json                 written last, by an atomic rename
    step000020/rank0.bin ...   raw bytes of the pieces rank r wrote, one after another

index.json: {"format": "playground-checkpoint", "version": 1, "step": steps taken, "data":
"step000020", "model": GPTConfig fields, "layout": Layout fields, "run": dtype, seed, lr,
"scalers": fp16 loss scalers, "optimizer_steps": AdamW's updates, "files": {"rank0.bin": bytes, ...}, "pieces": [{"kind":
"param" | "exp_avg" | "exp_avg_sq" | "buffer", "placement": {"name", "shape", "cuts"}, "file", "offset",
"nbytes", "dtype", "shape"}]}. A piece is a local tensor: a parameter's weights (the master
weights under mixed precision), AdamW's moments, or a "buffer" (optimizer-free state: the MoE
layers' balancing biases), each placed in the reference by its Placement (model/placement.py). Replicas are written once (by the lowest rank holding the
piece). No pickle is ever read: tensors are raw bytes, the index is JSON.

Saving is atomic: the ranks write `rank<r>.bin.tmp` in a new step folder, rename them after
every rank has written (a barrier), then one rank writes the index to a temporary name and
renames it over the old one, and removes the older step folders. A crash before the
index's rename leaves the previous checkpoint whole.

Loading (resharding): for each tensor a rank needs, the saved pieces of the same name and
kind whose range of the full tensor overlaps the needed one are read and assembled into
the full tensor, and the local piece is cut from it by its placement: TP slices with their
vocabulary padding, ZeRO flat shards with theirs, pipeline stages, expert ranges. AdamW's
step count is the updates it made (`optimizer_steps`: fewer than the steps where a step was
skipped, for a non-finite gradient or an fp16 overflow; every parameter takes the same
updates, so one count serves all). What is random
in training is a function of (seed, step): the data, and attention dropout's masks
(model/dropout.py reseeds its generators every step from (seed, rank, layer, step)), so
resuming at step k reads the same batches and draws the same masks an uninterrupted run
would; the fp16 loss scalers' state is in the index.

torch.distributed.checkpoint is not used: it needs torch.distributed's process groups
(simulated ranks are threads with none) and describes shards as DTensor placements, which
cannot say "a flat range of a padded tensor-parallel slice" (a ZeRO shard of a TP weight).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, fields

import numpy as np
import torch

from model.config import GPTConfig
from model.placement import Flat, Placement, Shard, paste, placement_from_dict, placement_to_dict

FORMAT, VERSION = "playground-checkpoint", 1
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and the problem."""


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _tensor(raw: bytes, dtype: str, shape) -> torch.Tensor:
    dt = DTYPES[dtype]
    if dt == torch.bfloat16:
        return torch.from_numpy(np.frombuffer(raw, dtype=np.int16).copy()).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(np.frombuffer(raw, dtype=torch.empty(0, dtype=dt).numpy().dtype).copy()).reshape(shape)


def _key(kind: str, pl: Placement) -> str:
    return f"{kind}|{json.dumps(placement_to_dict(pl), sort_keys=True)}"


def has_checkpoint(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "index.json"))


# -- saving -------------------------------------------------------------------------------------
def save(world, model, directory: str, step: int, meta: dict) -> int:
    """Every rank of `world` calls this after the optimizer step of `step` steps; returns
    the bytes the checkpoint's files hold."""
    pieces = model.state_pieces()
    keys = [_key(kind, pl) for kind, pl, _ in pieces]
    everyone = world.all_gather_object(keys)
    owner = {}
    for rank, ks in enumerate(everyone):
        for k in ks:
            owner.setdefault(k, rank)
    data = f"step{step:06d}"
    folder = os.path.join(directory, data)
    if world.rank == 0:
        os.makedirs(folder, exist_ok=True)
    world.barrier()
    name = f"rank{world.rank}.bin"
    entries, offset = [], 0
    with open(os.path.join(folder, name + ".tmp"), "wb") as f:
        for (kind, pl, t), k in zip(pieces, keys):
            if owner[k] != world.rank:
                continue  # a replica: its owner writes it
            raw = _bytes(t)
            f.write(raw)
            entries.append({"kind": kind, "placement": placement_to_dict(pl), "file": name, "offset": offset,
                            "nbytes": len(raw), "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
            offset += len(raw)
    world.barrier()  # every rank has written
    os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))
    gathered = world.all_gather_object((name, offset, entries))
    if world.rank == 0:
        index = {"format": FORMAT, "version": VERSION, "step": step, "data": data, **meta,
                 "files": {n: size for n, size, _ in gathered},
                 "pieces": [e for _, _, es in gathered for e in es]}
        tmp = os.path.join(directory, "index.json.tmp")
        with open(tmp, "w") as f:
            json.dump(index, f)
        os.replace(tmp, os.path.join(directory, "index.json"))
        for old in os.listdir(directory):  # earlier steps' data, no longer indexed
            if old.startswith("step") and old != data and os.path.isdir(os.path.join(directory, old)):
                shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    world.barrier()
    return sum(size for _, size, _ in gathered)


# -- reading ---------------------------------------------------------------------------------------
def read_index(directory: str, model: GPTConfig | None = None) -> dict:
    """The validated index: format, version, files present with the sizes it says, pieces
    within their files; with `model`, the same shapes as the checkpoint's model."""
    path = os.path.join(directory, "index.json")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint folder")
    if not os.path.exists(path):
        raise CheckpointError(f"{directory}: no index.json (not a checkpoint, or its save did not finish)")
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable index ({e})") from None
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a playground checkpoint (format {index.get('format')!r})")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {index.get('version')!r}; this playground reads version "
                              f"{VERSION}")
    folder = os.path.join(directory, index["data"])
    for name, size in index["files"].items():
        file = os.path.join(folder, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: missing (the index lists it, {size:,} bytes)")
        actual = os.path.getsize(file)
        if actual != size:
            raise CheckpointError(f"{file}: {actual:,} bytes, the index says {size:,} (truncated or replaced)")
    for p in index["pieces"]:
        if p["file"] not in index["files"] or p["offset"] + p["nbytes"] > index["files"][p["file"]]:
            raise CheckpointError(f"{path}: piece {p['kind']} of {p['placement']['name']} lies outside "
                                  f"{p['file']} (the index does not match its files)")
    if model is not None:
        saved = index["model"]
        shape_fields = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "n_experts", "moe_every",
                        "expert_d_ff", "n_shared_experts")
        differ = [f"{k} {saved.get(k)} != {getattr(model, k)}" for k in shape_fields if saved.get(k) != getattr(model, k)]
        if differ:
            raise CheckpointError(f"{path}: a checkpoint of another model ({', '.join(differ)}: checkpoint != this run)")
    return index


def _bounds(pl: Placement) -> tuple:
    """(lo, hi): a flat-index range of the full tensor holding every element the piece
    holds (exact for the common placements, computed without an index map)."""
    numel = int(torch.Size(pl.shape).numel())
    inner = numel // pl.shape[0] if pl.shape and pl.shape[0] else 1
    cuts = pl.cuts
    if not cuts:
        return 0, numel
    if len(cuts) == 1 and isinstance(cuts[0], Flat):
        return cuts[0].start, cuts[0].stop
    if isinstance(cuts[0], Shard) and cuts[0].dim == 0:
        s = cuts[0]
        lo, real = s.start * inner, (s.stop - s.start) * inner
        if len(cuts) == 1:
            return lo, lo + real
        if len(cuts) == 2 and isinstance(cuts[1], Flat):
            a, b = cuts[1].start, min(cuts[1].stop, real)
            return (lo + a, lo + b) if a < b else (0, 0)
    return 0, numel  # (conservative)


class Reader:
    """Assembles tensors of the reference from a checkpoint's pieces, reading each piece only
    when it overlaps what is asked; a piece saved with exactly the asked placement is read
    as it is (resuming on the same layout)."""

    def __init__(self, directory: str, index: dict):
        self.folder = os.path.join(directory, index["data"])
        self.by_name: dict = {}
        self.exact: dict = {}
        for p in index["pieces"]:
            pl = placement_from_dict(p["placement"])
            self.by_name.setdefault((p["kind"], pl.name), []).append((pl, p))
            self.exact[(p["kind"], pl)] = p
        self._cache: dict = {}

    def _read(self, p) -> torch.Tensor:
        with open(os.path.join(self.folder, p["file"]), "rb") as f:
            f.seek(p["offset"])
            raw = f.read(p["nbytes"])
        return _tensor(raw, p["dtype"], p["shape"])

    def full(self, kind: str, name: str, lo: int, hi: int) -> torch.Tensor:
        """The full tensor `name` of `kind`, valid at least on flat indices [lo, hi)."""
        key = (kind, name)
        have = self._cache.get(key)
        if have is not None and have[0] <= lo and hi <= have[1]:
            return have[2]
        saved = self.by_name.get(key)
        if not saved:
            raise CheckpointError(f"{self.folder}: no {kind} of {name} in the checkpoint")
        full = None
        for pl, p in saved:
            a, b = _bounds(pl)
            if b <= lo or a >= hi or a >= b:
                continue  # no overlap: not read
            t = self._read(p)
            if full is None:
                full = torch.zeros(pl.shape, dtype=t.dtype)
            paste(pl, full, t)
        if full is None:
            raise CheckpointError(f"{self.folder}: no piece of {kind} {name} covers elements [{lo}, {hi})")
        self._cache = {key: (lo, hi, full)}  # one full tensor at a time
        return full

    def fill(self, kind: str, pl: Placement) -> torch.Tensor:
        """The local tensor of `pl` (padding zero)."""
        p = self.exact.get((kind, pl))
        if p is not None:
            return self._read(p)
        lo, hi = _bounds(pl)
        return pl.local(self.full(kind, pl.name, lo, hi))


def load(model, directory: str, index: dict) -> int:
    """Fill `model` (a ParallelModel) from the checkpoint; returns the step to resume at."""
    reader = Reader(directory, index)
    # AdamW's own count: fewer than the steps where some were skipped (checkpoints written
    # before it was recorded: every step was taken)
    model.load_state(reader.fill, index.get("optimizer_steps", index["step"]))
    for scaler, saved in zip(getattr(model.optimizer, "scalers", []), index.get("scalers", [])):
        scaler.scale, scaler.good_steps, scaler.skipped = saved["scale"], saved["good_steps"], saved["skipped"]
    return index["step"]


def resume_point(index: dict, directory: str, run) -> tuple:
    """(the step `run` resumes at from this checkpoint, a note or None): raises CheckpointError
    when nothing is left to run (`run.steps` is the run's total, and the checkpoint is at or
    past it); the note says when the layout changes the global batch (the steps from here
    on then see other batches than the saved run's would)."""
    step = index["step"]
    if step >= run.steps:
        raise CheckpointError(f"--resume {directory}: the checkpoint is at step {step}, and --steps {run.steps} is the "
                              f"run's total: nothing left to run" + (" (give a larger --steps to train on)"
                                                                    if step == run.steps else ""))
    saved = index["layout"]
    before = saved["dp"] * saved["microbatches"] * saved["micro_batch_size"]
    now = run.layout
    if before == now.global_batch:
        return step, None
    return step, (f"resuming at step {step} with a global batch of {now.global_batch} sequences (dp {now.dp} × "
                  f"{now.microbatches} microbatches × {now.micro_batch_size}) where the saved run took {before} (dp "
                  f"{saved['dp']} × {saved['microbatches']} × {saved['micro_batch_size']}): the steps from here on see "
                  f"other batches; keep {before} sequences (e.g. --microbatches "
                  f"{max(1, before // (now.dp * now.micro_batch_size))}) to continue the same run")


def metadata(run, model) -> dict:
    """What a checkpoint records beside the pieces."""
    layout = asdict(run.layout)
    if layout.get("stage_layers") is not None:
        layout["stage_layers"] = list(layout["stage_layers"])
    scalers = [{"scale": s.scale, "good_steps": s.good_steps, "skipped": s.skipped}
               for s in getattr(model.optimizer, "scalers", [])]
    return {"model": run.model.to_dict(), "layout": layout, "scalers": scalers, "optimizer_steps": model.steps_taken(),
            "run": {"dtype": run.dtype, "seed": run.seed, "lr": run.lr, "betas": list(run.betas),
                    "weight_decay": run.weight_decay}}


def export(directory: str) -> dict:
    """The plain state_dict of the reference GPT (GPT.load_state_dict takes it)."""
    index = read_index(directory)
    reader = Reader(directory, index)
    cfg = GPTConfig(**{f.name: index["model"][f.name] for f in fields(GPTConfig) if f.name in index["model"]})
    from model import GPT
    names = [n for n, _ in GPT(cfg, device="meta").named_parameters()]
    out = {}
    for name in names:
        pl = next(pl for pl, _ in reader.by_name[("param", name)])
        out[name] = reader.full("param", name, 0, int(torch.Size(pl.shape).numel())).clone()
    return out
