"""`playground plan`: the real per-rank program on meta tensors. On a layout small enough
to run, the plan equals the simulated step of an actual run (same ops, same calls); a
layout too large for the profile's memory is flagged with its overshoot."""
import json
import subprocess
import sys

import pytest

from model import preset
from playground import Layout, RunConfig, train
from playground.planning import plan

CFG = preset("small", n_layers=2)


@pytest.mark.parametrize("layout", [Layout(dp=2, micro_batch_size=2),
                                    Layout(tp=2, pp=2, microbatches=2, micro_batch_size=2),
                                    Layout(cp=2, dp=2, zero=3, micro_batch_size=2)],
                         ids=["dp2", "tp2-pp2", "cp2-dp2-zero3"])
def test_the_plan_equals_the_simulated_step_of_a_real_run(layout):
    run = RunConfig(model=CFG, layout=layout, steps=2, hardware="h100-sxm", progress=False, count_every_step=True)
    real, planned = train(run), plan(run)
    for r in range(layout.world):
        a, b = real.values[r]["sim_steps"][-1], planned.values[r]["step"]
        assert b["time"] == pytest.approx(a["time"], rel=1e-4) and b["compute"] == pytest.approx(a["compute"], rel=1e-4)
        ma, mb = real.values[r]["memory"], planned.values[r]["memory"]
        for k in ("parameters", "gradients", "optimizer", "peak_comm_buffers"):
            assert ma[k] == mb[k], k
        assert mb["peak_activations"] == pytest.approx(ma["peak_activations"], rel=1e-3)  # (the token ids)


def test_plan_command_flags_what_does_not_fit(tmp_path):
    p = subprocess.run([sys.executable, "-m", "playground", "plan", "--model", "7b", "--micro-batch-size", "1",
                        "--hardware", "h100-sxm", "--json", str(tmp_path / "p.json")], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "OOM by" in p.stdout and "MFU" in p.stdout
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["schema"] == "playground.plan/1" and d["per_rank"][0]["fits"] is False
    states = sum(d["per_rank"][0]["memory"][k] for k in ("parameters", "gradients", "optimizer"))
    assert states == pytest.approx(16 * preset("7b").n_params(), rel=1e-3)  # bf16 copies + fp32 master and moments
    p = subprocess.run([sys.executable, "-m", "playground", "plan", "--model", "tiny"], capture_output=True, text=True)
    assert p.returncode == 2 and "--hardware is required" in p.stderr
