"""The committed GPU runs (benchmarks/results/gpu/runNN_*): each folder keeps a short
`summary.md` (what ran, on what, and its figures) and its raw files (the train JSONs, the
logs, profiles) in one `files.tar.xz`, which the benchmarks that read the runs
(fidelity.py, side_by_side.py, ac_gpu.py) open in place.

    python benchmarks/gpu_runs.py pack FOLDER...    # a fresh run's folder: summarize and compress
    python benchmarks/gpu_runs.py list FOLDER       # the files a run holds

`pack` writes the summary from the folder's train JSONs (model, layout, dtype, tokens/s,
median step, CUDA peak), keeping the run's own notes (`calls.txt`, `NOTES.md`) at its head,
then puts every file but the summary in the archive (sorted, without times or owners: the
same files give the same bytes) and removes them.
"""
from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import statistics
import sys
import tarfile

ARCHIVE = "files.tar.xz"
SUMMARY = "summary.md"
NOTES = ("NOTES.md", "calls.txt")  # a run's own account of what it ran, quoted in the summary


def _files(folder: str, pattern: str = "*") -> list:
    """[(name, bytes)] of a run's files matching `pattern` (a glob on the file name), sorted:
    in its archive, and loose in the folder (a run not packed yet, or files added since)."""
    out = {}
    archive = os.path.join(folder, ARCHIVE)
    if os.path.exists(archive):
        with tarfile.open(archive) as tar:
            for m in tar.getmembers():
                if m.isfile() and fnmatch.fnmatch(m.name, pattern):
                    out[m.name] = tar.extractfile(m).read()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name not in (ARCHIVE, SUMMARY) and os.path.isfile(path) and fnmatch.fnmatch(name, pattern):
            with open(path, "rb") as f:
                out[name] = f.read()
    return sorted(out.items())


def read(folder: str, pattern: str = "*") -> list:
    """[(name, text)] of a run's text files matching `pattern` (a glob on the file name)."""
    out = []
    for name, data in _files(folder, pattern):
        try:
            out.append((name, data.decode()))
        except UnicodeDecodeError:  # (an archive a run kept of its own)
            continue
    return out


def train_jsons(folder: str, pattern: str = "*.json") -> list:
    """[(name without .json, dict)] of the run's `playground train --json` outputs."""
    out = []
    for name, text in read(folder, pattern):
        try:
            d = json.loads(text)
        except ValueError:
            continue
        if isinstance(d, dict) and "layout" in d and "throughput" in d:
            out.append((name[:-len(".json")], d))
    return out


def step_times(throughput: dict) -> list:
    """A train JSON's steps as its tokens/s counts them: the device's where it recorded them
    (playground/device_steps.py: the host may run ahead of the device), else the host's."""
    return throughput.get("device_step_times_s") or throughput.get("step_times_s") or []


def _figures(d: dict) -> list:
    lay, run, t = d["layout"], d["run"], d["throughput"]
    axes = " × ".join(f"{k} {lay[k]}" for k in ("dp", "tp", "pp", "cp", "ep") if lay.get(k, 1) > 1) or "1 GPU"
    extra = [f"zero {lay['zero']}"] if lay.get("zero") else []
    extra += [f"ac {lay['ac']}"] if lay.get("ac", "none") != "none" else []
    extra += ["sp"] if lay.get("sequence_parallel") else []
    steps = step_times(t)
    step = statistics.median(steps[1:]) if len(steps) > 1 else None
    peak = max((r.get("cuda_peak_allocated", 0) for r in d.get("memory") or []), default=0)
    return [f"{d['model'].get('n_params', 0) / 1e9:.2f}B, d_model {d['model']['d_model']}",
            ", ".join([axes] + extra) + f", micro-batch {lay.get('micro_batch_size', '?')}",
            run.get("dtype", "?") + (" + bf16 copies" if run.get("bf16_copies") else ""),
            f"{t['tokens_per_s']:,.0f}", f"{step * 1e3:.1f} ms" if step else "-",
            f"{peak / 2**30:.2f} GiB" if peak else "-"]


def summary(folder: str) -> str:
    """The run's summary: its notes, its GPUs, a table of its train JSONs, and its files."""
    name = os.path.basename(os.path.normpath(folder))
    lines = [f"# {name}", ""]
    for note, text in read(folder):
        if note in NOTES:
            lines += [text.strip(), ""]
    gpus = dict(read(folder, "gpus.txt")).get("gpus.txt", "").strip().splitlines()
    if gpus:
        lines += [f"GPUs: {gpus[0].strip()}" + (f" (and {len(gpus) - 1} more lines in gpus.txt)" if len(gpus) > 1
                                                   else ""), ""]
    runs = train_jsons(folder)
    peers = [(n[:-len(".json")], json.loads(t)) for n, t in read(folder, "torch_*.json")]
    if peers:  # plain PyTorch beside the playground (benchmarks/gpu_side_by_side.py)
        lines += ["| torch run | model | GPUs | mode | micro-batch | ac | tokens/s | median step | CUDA peak |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {n} | {d.get('model')} | {d.get('world')} | {d.get('mode')} | {d.get('mbs')} | {d.get('ac')} | "
                  f"{d.get('tokens_per_s', 0):,.0f} | {d.get('median_step_s', 0) * 1e3:.1f} ms | "
                  f"{d.get('cuda_peak_allocated', 0) / 2**30:.2f} GiB |" for n, d in peers]
        lines.append("")
    if runs:
        lines += ["| run | model | layout | dtype | tokens/s | median step | CUDA peak |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {n} | " + " | ".join(_figures(d)) + " |" for n, d in runs]
        lines.append("")
    files = [n for n, _ in _files(folder)]
    lines += [f"Files in {ARCHIVE} ({len(files)}): " + ", ".join(files), ""]
    return "\n".join(lines)


def pack(folder: str) -> None:
    """Summarize the folder and move its files into the archive (adding to one already there)."""
    files = _files(folder)
    text = summary(folder)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    with open(os.path.join(folder, ARCHIVE), "wb") as f:
        f.write(buf.getvalue())
    with open(os.path.join(folder, SUMMARY), "w") as f:
        f.write(text)
    for name, _ in files:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            os.remove(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="summarize and compress run folders")
    p.add_argument("folders", nargs="+")
    q = sub.add_parser("list", help="the files a run holds")
    q.add_argument("folder")
    a = ap.parse_args()
    if a.verb == "pack":
        for folder in a.folders:
            if not os.path.isdir(folder):
                sys.exit(f"gpu_runs: {folder}: not a folder")
            pack(folder)
            print(f"{folder}: {SUMMARY}, {ARCHIVE} ({os.path.getsize(os.path.join(folder, ARCHIVE)):,} bytes)")
    else:
        for name, data in _files(a.folder):
            print(f"{len(data):>10,}  {name}")


if __name__ == "__main__":
    main()
