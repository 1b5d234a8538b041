"""Tokens/s on a GPU counts the device's steps, not the host's (playground/device_steps.py)."""
import json
import subprocess
import sys

import pytest
import torch

from model import preset
from playground import Layout, RunConfig, train
from playground.summary import train_json
from playground.training import TrainResult


def _result(values, step_times):
    run = RunConfig(model=preset("tiny"), layout=Layout(), steps=len(step_times), progress=False)
    return TrainResult(run, [1.0] * len(step_times), step_times, 1.0, None, None, "markov", values)


def test_tokens_per_s_is_the_median_of_the_devices_steps_where_they_were_recorded():
    host = [0.5, 0.03, 0.03, 0.03, 0.03]  # a host launching ahead of its device
    device = [0.6, 0.05, 0.04, 0.05, 0.05]
    on_gpu = _result([{"device_step_times": device}], host)
    assert on_gpu.tokens_per_s == pytest.approx(on_gpu.run.tokens_per_step / 0.05)
    on_cpu = _result([{}], host)  # (no device: the host's wall time)
    assert on_cpu.tokens_per_s == pytest.approx(on_cpu.run.tokens_per_step / 0.03)


def test_a_cpu_run_records_no_device_steps():
    res = train(RunConfig(model=preset("tiny"), layout=Layout(dp=2), steps=2, progress=False))
    assert res.device_step_times is None
    assert train_json(res)["throughput"]["device_step_times_s"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's steps are CUDA events")
def test_the_devices_steps_add_up_to_no_more_than_the_run(tmp_path):
    """Without the NaN check's read nothing makes the host wait each step: the device's steps
    are recorded, each step, and they add up to no more than the run's wall time."""
    out = tmp_path / "small.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "playground",
                    "train", "--backend", "torch", "--model", "small",
                    "--micro-batch-size", "4", "--dtype", "bfloat16", "--steps", "6", "--on-nan", "off",
                    "--no-progress", "--json", str(out)], check=True, capture_output=True)
    d = json.loads(out.read_text())
    t = d["throughput"]
    device = t["device_step_times_s"]
    assert len(device) == 6 and all(s > 0 for s in device)
    assert sum(device) <= t["wall_s"]
    assert t["tokens_per_s"] == pytest.approx(d["run"]["tokens_per_step"] / sorted(device)[len(device) // 2])
