"""Whether a resumed run is the uninterrupted one, bit for bit, from what each left behind:
two checkpoints of the same layout at the same step (every piece's bytes: the weights,
AdamW's moments, the MoE balancing biases; AdamW's step count in the index) and, where
given, the two train JSONs' losses over the steps the resumed run took.

    python benchmarks/resume_compare.py WHOLE_DIR RESUMED_DIR [--losses WHOLE.json RESUMED.json]

Prints one line, `same` or `differs` with the first differences; exit status 0 or 1. On a
GPU the uninterrupted run twice is the control: a kernel that is not deterministic from run
to run would make the two differ without any fault of the resume.
"""
import argparse
import json
import os
import sys

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from playground.checkpoint import read_index  # noqa: E402


def pieces(directory: str) -> tuple:
    """(the index, {(kind, placement as JSON): the piece's bytes})."""
    index = read_index(directory)
    out = {}
    for p in index["pieces"]:
        with open(os.path.join(directory, index["data"], p["file"]), "rb") as f:
            f.seek(p["offset"])
            out[(p["kind"], json.dumps(p["placement"], sort_keys=True))] = f.read(p["nbytes"])
    return index, out


def differences(whole: str, resumed: str, losses: list | None) -> list:
    (a_index, a), (b_index, b) = pieces(whole), pieces(resumed)
    out = []
    for key in ("step", "optimizer_steps"):
        if a_index.get(key) != b_index.get(key):
            out.append(f"{key} {a_index.get(key)} against {b_index.get(key)}")
    if a.keys() != b.keys():
        out.append(f"pieces {sorted(set(a) ^ set(b))[:2]} in one only")
    out += [f"{kind} {json.loads(pl)['name']}" for (kind, pl) in sorted(a.keys() & b.keys()) if a[kind, pl] != b[kind, pl]]
    if losses:
        per_run = [json.load(open(f))["loss"]["per_step"] for f in losses]
        tail = per_run[0][-len(per_run[1]):]
        if tail != per_run[1]:
            out.insert(0, f"losses {tail} against {per_run[1]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("whole")
    ap.add_argument("resumed")
    ap.add_argument("--losses", nargs=2, metavar=("WHOLE_JSON", "RESUMED_JSON"))
    a = ap.parse_args()
    found = differences(a.whole, a.resumed, a.losses)
    if found:
        verdict = f"differs in {len(found)}: " + "; ".join(found[:4])
    else:
        losses = ", and the losses" if a.losses else ""
        verdict = f"same (every one of {len(pieces(a.whole)[1])} pieces bit for bit{losses})"
    print(f"{a.whole} against {a.resumed}: {verdict}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
