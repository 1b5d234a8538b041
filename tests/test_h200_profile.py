"""benchmarks/h200_profile.py: the shipped H200 profile takes a one-GPU calibration's fields
and keeps what only two GPUs measure from the 2-GPU one."""
import copy
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.h200_profile import KEPT, TWO_GPU, merged  # noqa: E402
from model import GPTConfig  # noqa: E402
from playground.calibrate import gemm_shapes  # noqa: E402
from simulator.hardware import CALIBRATED, hardware_from_dict  # noqa: E402


def _profiles():
    with open(os.path.join(CALIBRATED, "h200.json")) as f:
        shipped = json.load(f)
    links = copy.deepcopy(shipped)
    links["calibration"]["ranks"] = 2
    links["calibration"].pop("two_gpu", None)
    links["calibration"].setdefault("collectives", [])
    fresh = copy.deepcopy(shipped)
    fresh.update(name="h200-1b", matmul_fraction=0.78, kernel_floor=2.5e-5, hbm_fraction=0.7, nvlink_latency=2e-6, collective_floor=None,
                 sm_count=None, matmul_tiles=None, source="playground calibrate on 1× NVIDIA H200 (2026-12-07); "
                 "peaks, HBM bandwidth and network from h200-datasheet; NVLink not measured (one rank)")
    fresh["calibration"].update(ranks=1, device="NVIDIA H200")
    # a fresh record's GEMMs: the products a step of its model runs, as calibrate records them
    cfg = GPTConfig(**fresh["calibration"]["model"])
    fresh["calibration"]["matmuls"] = [
        {"m": m, "k": k, "n": n, "dtype": dtype, "flops": 2 * m * k * n, "per_step": per_step,
         "seconds": 2 * m * k * n / rate}
        for dtype, rate in (("bfloat16", 700e12), ("float32", 50e12))
        for m, k, n, per_step in gemm_shapes(cfg, fresh["calibration"]["micro_batch"] * cfg.seq_len)]
    return fresh, links


def test_the_fresh_fields_and_the_two_gpu_links():
    fresh, links = _profiles()
    out = merged(fresh, links)
    hw, cfg = hardware_from_dict(out), GPTConfig(**out["calibration"]["model"])
    assert hw.name == "h200" and hw.kernel_floor == 2.5e-5 and hw.hbm_fraction == 0.7
    for k in (*TWO_GPU, *KEPT):
        assert out[k] == links[k], k
    assert "NVLink not measured" not in hw.source and "from playground calibrate on 2×" in hw.source
    assert out["calibration"]["ranks"] == 1 and out["calibration"]["two_gpu"]["ranks"] == 2
    # the GEMMs refitted in the kept tiles: a step of the record's model plans them at their measured time
    for dtype in ("bfloat16", "float32"):
        rows = [r for r in out["calibration"]["matmuls"] if r["dtype"] == dtype]
        shapes = gemm_shapes(cfg, out["calibration"]["micro_batch"] * cfg.seq_len)
        assert [(r["m"], r["k"], r["n"], r["per_step"]) for r in rows] == shapes
        assert sum(r["per_step"] * r["predicted"] for r in rows) == \
            pytest.approx(sum(r["per_step"] * r["seconds"] for r in rows), rel=1e-9)
    assert out["matmul_fraction"] != fresh["matmul_fraction"] and "retiled" in out["sources"]["matmul_fraction"]
    again = merged(fresh, out)  # (the profile written is the next refit's links)
    assert again["calibration"]["two_gpu"] == out["calibration"]["two_gpu"] and again["source"] == out["source"]


def test_it_refuses_a_calibration_of_another_gpu():
    fresh, links = _profiles()
    fresh["calibration"]["device"] = "NVIDIA H100 80GB HBM3"
    with pytest.raises(SystemExit, match="one H200's calibration and a 2-GPU one, got 1× NVIDIA H100"):
        merged(fresh, links)
