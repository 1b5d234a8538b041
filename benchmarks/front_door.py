"""Benchmark: the front door under bad input. Each case runs the installed `playground`
as a new user would, in a scratch folder, and the table gives the first line it printed,
how many lines it printed, its exit status and how long it took to answer.

What a user should get for a bad input (docs/architecture.md, "The front door"): one line
on stderr naming the flag or file and the values involved, exit status 2, before any work
starts, and quickly (a bad flag answers before torch is imported). A case that runs past
--timeout seconds is reported as a timeout: a silent unbounded run.

    python benchmarks/front_door.py                     # every case
    python benchmarks/front_door.py --only lr,seed      # the cases whose name has one of these
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import default_json, median, print_table, write_json  # noqa: E402

NO_DIR = "afile"  # a plain file in the scratch folder: nothing can be written under it, even by root

# (name, argv after `playground`): every case is an input a user can type by mistake
CASES = [
    ("world 0", "train --world 0"),
    ("world -2", "train --world -2"),
    ("dp 0", "train --dp 0"),
    ("tp -1", "train --tp -1"),
    ("lr nan", "train --lr nan"),
    ("lr -1", "train --lr -1"),
    ("lr inf", "train --lr inf --steps 3"),
    ("lr 0", "train --lr 0"),
    ("seed -1", "train --seed -1"),
    ("steps 0", "train --steps 0"),
    ("microbatches 0", "train --microbatches 0"),
    ("micro-batch-size 0", "train --micro-batch-size 0"),
    ("micro-batch-size 1.5", "train --micro-batch-size 1.5"),
    ("model nonexistent", "train --model nonexistent"),
    ("dtype float8", "train --dtype float8"),
    ("unknown flag", "train --tensor-parallel 2"),
    ("no verb", ""),
    ("bucket-mb 0", "train --dp 2 --bucket-mb 0"),
    ("bucket-mb nan", "train --dp 2 --bucket-mb nan"),
    ("save-every 0", "train --save ck --save-every 0"),
    ("save-every without save", "train --save-every 2"),
    ("overwrite without save", "train --overwrite"),
    ("virtual-stages 0", "train --pp 2 --virtual-stages 0"),
    ("stage-layers bad", "train --pp 2 --stage-layers a,b"),
    ("stage-layers sum", "train --pp 2 --stage-layers 1,2"),
    ("experts -1", "train --experts -1"),
    ("top-k 0", "train --model tiny-moe --top-k 0"),
    ("top-k > experts", "train --model tiny-moe --top-k 9"),
    ("capacity-factor -1", "train --model tiny-moe --capacity-factor -1"),
    ("aux-loss-coef nan", "train --model tiny-moe --aux-loss-coef nan"),
    ("z-loss-coef -1", "train --model tiny-moe --z-loss-coef -1"),
    ("moe-every 0", "train --model tiny-moe --moe-every 0"),
    ("experts without MoE", "train --top-k 2"),
    ("seq-len 1", "train --seq-len 1"),
    ("seq-len 100000", "train --seq-len 100000"),
    ("model-config repeated key", "train --model-config n_layers=2,n_layers=3"),
    ("model-config n_layers=0", "train --model-config n_layers=0"),
    ("model-config unknown key", "train --model-config depth=2"),
    ("model-config bad value", "train --model-config d_model=abc"),
    ("schedule without pp", "train --schedule zb1"),
    ("cp-impl without cp", "train --cp-impl ulysses"),
    ("cp-balance without cp", "train --cp-balance contiguous"),
    ("sp without tp", "train --sp"),
    ("virtual-stages without pp", "train --virtual-stages 2"),
    ("reduce-dtype without zero", "train --reduce-dtype bfloat16"),
    ("bf16-copies float32", "train --bf16-copies"),
    ("autocast float32", "train --autocast"),
    ("autocast with zero", "train --dtype bfloat16 --dp 2 --zero 1 --autocast"),
    ("hardware unknown", "train --hardware tpu-v9"),
    ("hardware malformed JSON", "train --hardware bad.json"),
    ("hardware missing file", "train --hardware missing.toml"),
    ("trace without hardware", "train --trace t.json"),
    ("data missing", "train --data missing.txt"),
    ("json under a plain file", f"train --json {NO_DIR}/x.json"),
    ("json unwritable", "train --json /proc/x.json"),
    ("plots unwritable", "train --plots /proc/plots"),
    ("save under a plain file", f"train --save {NO_DIR}/ck"),
    ("trace unwritable", "train --hardware h100-sxm --trace /proc/t.json"),
    ("resume missing", "train --resume missing_ck"),
    ("init-from missing", "train --init-from missing.pt"),
    ("check with save", "check --save ck2"),
    ("check json unwritable", "check --json /proc/x.json"),
    ("plan without hardware", "plan --model 70b --dp 8"),
    ("plan dp 100000", "plan --model 70b --dp 100000 --hardware h100-sxm"),
    ("plan memory-headroom 2", "plan --hardware h100-sxm --memory-headroom 2"),
    ("plan search without world", "plan --hardware h100-sxm --search"),
    ("plan global-batch indivisible", "plan --hardware h100-sxm --dp 3 --global-batch 10"),
    ("plan top 0", "plan --hardware h100-sxm --search --world 8 --global-batch 32 --top 0"),
    ("plan json unwritable", "plan --hardware h100-sxm --json /proc/x.json"),
    ("calibrate out under a plain file", f"calibrate --backend gloo --world 2 --model tiny --out {NO_DIR}/x.json"),
    ("calibrate micro-batch-size 0", "calibrate --backend gloo --world 2 --model tiny --micro-batch-size 0 --out c.json"),
    ("calibrate max-mib -5", "calibrate --backend gloo --world 2 --model tiny --max-mib -5 --out c.json"),
    ("calibrate world 0", "calibrate --backend gloo --world 0 --model tiny --out c.json"),
    ("export under a plain file", f"export ck {NO_DIR}/gpt.pt"),
    ("export missing checkpoint", "export missing_ck gpt.pt"),
    ("bench unknown", "bench nonexistent"),
]


def _scratch(d: str, checkout=None) -> None:
    """The files the cases name: a malformed profile, a plain file and a real checkpoint."""
    with open(os.path.join(d, "bad.json"), "w") as f:
        f.write("{name: 'h100', peak_tflops: 989,}\n")
    with open(os.path.join(d, NO_DIR), "w") as f:
        f.write("a file, not a folder\n")
    subprocess.run(_cmd("train --steps 1 --save ck --no-progress", checkout), cwd=d, capture_output=True,
                   timeout=300, check=True, env=_env(checkout))


def _cmd(args: str, checkout=None) -> list:
    """The command line: the installed `playground`, or `python -m playground` of `checkout`."""
    exe = shutil.which("playground")
    if exe and checkout is None:
        return [exe] + args.split()
    return [sys.executable, "-m", "playground"] + args.split()


def _env(checkout=None) -> dict:
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = checkout
    return env


def run_case(args: str, cwd: str, timeout: float, checkout=None) -> dict:
    t0 = time.monotonic()
    p = subprocess.Popen(_cmd(args, checkout) + (["--no-progress"] if args.startswith("train") else []), cwd=cwd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=_env(checkout))
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return {"status": "timeout", "seconds": round(time.monotonic() - t0, 2), "lines": len((out + err).splitlines()),
                "first": (err or out).strip().splitlines()[0] if (err or out).strip() else ""}
    text = err if err.strip() else out
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return {"status": p.returncode, "seconds": round(time.monotonic() - t0, 2),
            "lines": len(lines), "first": lines[0] if lines else "", "traceback": "Traceback" in err}


def interrupt(cwd: str, after: float, checkout=None) -> dict:
    """Ctrl-C `after` seconds into a run (while torch is still being imported at 0.3-0.8 s)."""
    p = subprocess.Popen(_cmd("train --world 4 --steps 5000 --no-progress", checkout), cwd=cwd,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(checkout),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return {"status": "timeout", "seconds": 30, "lines": 0, "first": ""}
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return {"status": p.returncode, "seconds": after, "lines": len(lines), "first": lines[0] if lines else "",
            "traceback": "Traceback" in err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds before a case counts as a silent run")
    ap.add_argument("--only", help="comma-separated parts of case names")
    ap.add_argument("--checkout", help="run `python -m playground` from this source tree (e.g. a git worktree of an "
                                       "older commit) instead of the installed command")
    ap.add_argument("--json", default=default_json("front_door"))
    a = ap.parse_args()
    checkout = os.path.abspath(a.checkout) if a.checkout else None
    cases = [(n, c) for n, c in CASES if not a.only or any(s in n for s in a.only.split(","))]
    out = []
    with tempfile.TemporaryDirectory() as d:
        _scratch(d, checkout)
        for name, args in cases:
            r = run_case(args, d, a.timeout, checkout)
            out.append({"name": name, "args": args, **r})
            print(f"  {name:<34} {r['status']!s:>7} {r['seconds']:6.2f}s {r['lines']:3d} lines  {r['first'][:90]}",
                  flush=True)
        for after in (0.1, 0.3, 0.5, 0.8, 1.2, 3.0):
            if not a.only or "ctrl-c" in a.only:
                r = interrupt(d, after, checkout)
                out.append({"name": f"ctrl-c at {after} s", "args": "train --world 4 --steps 5000", **r})
    rows = [(r["name"], r["status"], r["lines"], f"{r['seconds']:.2f}", r["first"][:100]) for r in out]
    print_table("bad input: exit status, lines printed, seconds to answer, first line",
                ["case", "status", "lines", "s", "first line"], rows)
    good = [r for r in out if r["status"] == 2 and r["lines"] == 1] + \
           [r for r in out if r["name"].startswith("ctrl-c") and r["status"] == 130 and r["lines"] == 1]
    quick = [r["seconds"] for r in out if r["status"] == 2]
    print(f"\n{len(good)} of {len(out)} cases answer in one line with the right status; median answer "
          f"{median(quick) if quick else float('nan'):.2f} s")
    write_json(a.json, {"timeout": a.timeout, "cases": out})


if __name__ == "__main__":
    main()
