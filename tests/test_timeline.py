"""The pictures tell the truth: the clock's timeline accounts for every second of the
breakdown as what it was (kernels by op, waits for the host, idle, the bubble, exposed
communication), the trace names events by op, the memory table and plot share one split
that sums to the peak, and the plots stay readable at 1024 ranks."""
import json
import struct
from types import SimpleNamespace

import pytest

from model.config import preset
from playground import Layout, RunConfig, train


@pytest.fixture(scope="module")
def pipelined():
    """A zero-bubble pipeline on the tiny model with simulated time: every kind of span."""
    return train(RunConfig(model=preset("tiny"), layout=Layout(pp=2, dp=2, microbatches=4, schedule="zb1"), steps=3,
                           hardware="h100-sxm", progress=False))


def test_the_timeline_accounts_for_every_second_of_the_breakdown(pipelined):
    for clock in pipelined.clocks:
        spent: dict = {}
        last = 0.0
        for kind, name, start, end in clock.events:
            assert end > start >= last - 1e-15  # in order, not overlapping
            last = end
            spent[kind] = spent.get(kind, 0.0) + end - start
            assert (name is not None) == (kind == "compute")
        assert spent["compute"] == pytest.approx(clock.compute, rel=1e-9)
        assert spent.get("host", 0.0) == pytest.approx(clock.host, rel=1e-9, abs=1e-15)
        assert spent.get("bubble", 0.0) == pytest.approx(clock.bubble, rel=1e-9, abs=1e-15)
        assert spent.get("idle", 0.0) + spent.get("bubble", 0.0) == pytest.approx(clock.idle, rel=1e-9, abs=1e-15)
        assert spent.get("exposed", 0.0) == pytest.approx(clock.exposed, rel=1e-9, abs=1e-15)
        assert sum(spent.values()) == pytest.approx(clock.now, rel=1e-9)  # nothing else: the stream is covered
    kinds = {e[0] for c in pipelined.clocks for e in c.events}
    assert {"compute", "host", "bubble"} <= kinds


def test_the_trace_names_compute_by_its_op_and_each_wait_by_what_it_is(pipelined):
    from simulator.trace import chrome_trace
    events = [e for e in chrome_trace(pipelined.ledger, pipelined.clocks)["traceEvents"] if e["ph"] == "X"]
    compute = {e["name"] for e in events if e["tid"] == 0 and e["cat"] == "compute"}
    assert {"mm", "_fused_adamw"} <= compute and "compute" not in compute
    stalls = {e["name"] for e in events if e["tid"] == 0 and e["cat"] != "compute"}
    assert {"waiting for the host", "pipeline bubble"} <= stalls


def test_memory_table_and_plot_share_one_split_that_sums_to_the_peak(pipelined, tmp_path):
    from playground.plots import write_plots
    from playground.report import memory_at_peak, memory_table
    peaks = [v["memory"]["peak_total"] for v in pipelined.values]
    for v in pipelined.values:
        assert sum(memory_at_peak(v["memory"]).values()) == v["memory"]["peak_total"]
        assert memory_at_peak(v["memory"])["backward temporaries"] > 0  # (left out of the plot before)
    top = max(range(len(peaks)), key=peaks.__getitem__)
    assert f"rank {top} (largest peak)" in memory_table(pipelined)
    written = write_plots(pipelined, str(tmp_path))
    assert {p.split("/")[-1] for p in written} == {"schedule.png", "loss.png", "bytes.png", "timeline.png",
                                                   "memory.png"}


def test_identical_ranks_share_a_row_of_simulated_time():
    from playground.report import simulated_time
    res = train(RunConfig(model=preset("tiny"), layout=Layout(dp=4), steps=2, hardware="h100-sxm", progress=False))
    text = simulated_time(res)
    assert "ranks 0-3" in text and "rank 1 " not in text


def test_plot_families_merge_stages_cap_the_legend_and_drop_silent_labels():
    from playground.plots import LEGEND_MAX, _by_family, plot_family
    assert plot_family("zero.pp16.grads.unit3") == "zero.grads.unit*"
    assert plot_family("ddp.bucket12") == "ddp.bucket*"
    bars = [{f"fam{i}.x": float(i + 1) for i in range(40)} | {"silent": 0.0} for _ in range(3)]
    series = _by_family(bars, 1.0)
    assert "silent" not in series and len(series) == LEGEND_MAX + 1
    other = [k for k in series if k.startswith("other")]
    assert other == [f"other ({40 - LEGEND_MAX} families)"]
    assert sum(v[0] for v in series.values()) == pytest.approx(sum(range(1, 41)))


def _png_size(path) -> tuple:
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24])


@pytest.mark.slow  # (at scale: the default tier draws and plans small layouts)
def test_a_64_stage_schedule_is_drawn_readably(tmp_path):
    """pp 64 with 128 microbatches: 32 of the rows, boxes unlabelled where a label would not
    fit, a bounded picture."""
    from playground.plots import pipeline_schedule
    res = SimpleNamespace(run=SimpleNamespace(layout=Layout(pp=64, microbatches=128)))
    path = tmp_path / "schedule.png"
    pipeline_schedule(res, str(path))
    width, height = _png_size(path)
    assert width <= 3200 and height <= 2200


@pytest.mark.slow  # (at scale: the default tier draws and plans small layouts)
def test_plan_json_and_plots_at_scale_stay_bounded(tmp_path, cli):
    status, out, err = cli("plan", "--model", "tiny", "--dp", "256", "--tp", "2", "--pp", "2", "--hardware",
                           "h100-sxm", "--plots", tmp_path, "--json", tmp_path / "p.json")
    assert status == 0, err
    for name in ("step.png", "memory.png", "bytes.png", "timeline.png", "schedule.png"):
        width, height = _png_size(tmp_path / name)
        assert width <= 3200 and height <= 2600, (name, width, height)
    d = json.loads((tmp_path / "p.json").read_text())
    assert len(d["per_rank"]) == 1024


def test_a_learners_run_says_how_to_see_the_simulated_step_and_the_bubble_of_too_few_microbatches():
    """`train --pp 2` with one microbatch and no --hardware: the report names the bubble of its
    schedule ((p-1)/(m+p-1), Narayanan et al. 2021) and the flag that times the step on a GPU;
    with --hardware and enough microbatches, neither line."""
    from playground.report import train_summary
    bare = train_summary(train(RunConfig(model=preset("tiny"), layout=Layout(pp=2, dp=2), steps=2, progress=False)))
    assert "1 microbatch for 2 stages" in bare and "= 50% of the step" in bare and "--microbatches 8" in bare
    assert "simulated time: --hardware h100-sxm" in bare and "the pipeline's bubble" in bare
    full = train_summary(train(RunConfig(model=preset("tiny"), layout=Layout(pp=2, microbatches=4), steps=2,
                                         hardware="h100-sxm", progress=False)))
    assert "microbatch for" not in full and "simulated time: --hardware" not in full and "simulated on h100-sxm" in full
