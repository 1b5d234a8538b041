"""The shipped H200 profile (simulator/profiles/h200.json) from a one-GPU `playground
calibrate` on an H200 (benchmarks/h200_refit_gpu.sh) and the 2-GPU calibration it replaces:
every field one GPU measures is the fresh one's; what only two GPUs measure (NVLink's α and
1/β, Hockney 1994, and the host's cost per collective call) and what no calibration measures
(the SM count, a datasheet number, and cuBLAS's tile shapes) stay the earlier profile's, each
named in the file's `sources`. The earlier profile's 2-GPU record of them stays in the fresh
record, as its `two_gpu`. The matmul fraction is refitted in the kept tiles (`retiled`): a
calibration on the datasheet base, which has none, fits a fraction that holds their waste
already, and the tiles would count it twice.

    python benchmarks/h200_profile.py --fresh h200-1b.json --links simulator/profiles/h200.json \
        --out simulator/profiles/h200.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import PRESETS, preset  # noqa: E402
from playground.calibrate import fit_matmuls, matmuls_predicted  # noqa: E402
from simulator.hardware import hardware_from_dict  # noqa: E402

TWO_GPU = ("nvlink_latency", "nvlink_bandwidth", "collective_floor")  # what one GPU cannot measure
KEPT = ("sm_count", "matmul_tiles")  # what no calibration measures


def model_name(cfg: dict) -> str:
    """The preset a calibration record's model is, or its width and depth."""
    for name in PRESETS:
        if preset(name).to_dict() == cfg:
            return name
    return f"d_model {cfg['d_model']}, {cfg['n_layers']} layers"


def retiled(profile: dict) -> dict:
    """`profile` with its matmul_fraction and fp32_flops refitted from its record's timed GEMMs
    in its own sm_count and matmul_tiles (calibrate.fit_matmuls: each GEMM as often as a step
    runs it, its FLOPs in whole tiles and waves), and the record's GEMMs predicted again."""
    rec = profile["calibration"]
    by_dtype = {dtype: [r for r in rec["matmuls"] if r["dtype"] == dtype] for dtype in ("bfloat16", "float32")}
    if not all("per_step" in r for rows in by_dtype.values() for r in rows):
        raise SystemExit("h200_profile: the record's GEMMs say not how often a step runs them (per_step): "
                         "calibrate again with this playground")
    fraction, fp32 = fit_matmuls(by_dtype["bfloat16"], by_dtype["float32"], hardware_from_dict(profile))
    out = {**profile, "matmul_fraction": fraction, "fp32_flops": fp32}
    out["calibration"] = {**rec, "matmuls": matmuls_predicted(by_dtype["bfloat16"] + by_dtype["float32"],
                                                              hardware_from_dict(out))}
    return out


def merged(fresh: dict, links: dict) -> dict:
    """The profile: `fresh`'s fields and record, `links`'s TWO_GPU and KEPT fields."""
    rec = fresh["calibration"]
    # (a profile this wrote keeps its 2-GPU record as `two_gpu`: it can be the next one's `links`)
    two = links["calibration"].get("two_gpu") or {
        "source": links["source"].split(";")[0],
        **{k: links["calibration"][k] for k in ("ranks", "device", "collective_floor", "collectives")}}
    if "H200" not in rec["device"] or rec["ranks"] != 1 or two["ranks"] < 2:
        raise SystemExit(f"h200_profile: wants one H200's calibration and a 2-GPU one, got {rec['ranks']}× "
                         f"{rec['device']} and {two['ranks']}× {two['device']}")
    out = {k: v for k, v in fresh.items() if k != "calibration"}
    for k in (*TWO_GPU, *KEPT):
        if links.get(k) is not None:
            out[k] = links[k]
    out["name"] = "h200"
    out["source"] = (f"{fresh['source'].replace('; NVLink not measured (one rank)', '')}; NVLink α, 1/β and collective_floor from {two['source']}")
    out["sources"] = {
        "calibrated": "every field but those below: playground calibrate on one "
                      f"{rec['device']}, the model {model_name(rec['model'])} at micro-batch {rec['micro_batch']} "
                      "(the `calibration` record)",
        "two_gpu": f"{', '.join(TWO_GPU)}: {two['source']} (the record's `two_gpu`)",
        "datasheet": "peak_bf16_flops, hbm_bandwidth, network_bandwidth, network_latency, gpus_per_node: h200-datasheet",
        "sm_count": "datasheet: 132 SMs (the H200 SXM's GH100)",
        "matmul_tiles": "cuBLAS's common Hopper tile shapes, as profiles/h100-sxm.json",
        "matmul_fraction": "the calibration's timed GEMMs, refitted in these tiles (benchmarks/h200_profile.py, "
                           "`retiled`)",
    }
    out["calibration"] = {**rec, "two_gpu": two}
    out = retiled(out)
    hardware_from_dict(out, "merged")  # (every field valid)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fresh", required=True, help="the one-GPU calibration (a profile file)")
    ap.add_argument("--links", required=True, help="the 2-GPU calibrated profile whose links are kept")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with open(a.fresh) as f, open(a.links) as g:
        fresh, links = json.load(f), json.load(g)
    out = merged(fresh, links)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{a.out}: {', '.join(f'{k} {out[k]}' for k in ('matmul_fraction', 'hbm_fraction', 'kernel_floor'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
