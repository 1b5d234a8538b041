"""The committed GPU runs are read from their archives as they were from the loose files."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpu_runs  # noqa: E402

TRAIN = {"schema": "playground.train/1", "model": {"n_params": 4e8, "d_model": 1024},
         "layout": {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 3, "micro_batch_size": 8, "ac": "none"},
         "run": {"dtype": "bfloat16", "bf16_copies": False},
         "throughput": {"tokens_per_s": 123456.0, "step_times_s": [1.0, 0.1, 0.2, 0.3]},
         "memory": [{"cuda_peak_allocated": 2 * 2**30}, {"cuda_peak_allocated": 3 * 2**30}]}


def _run(folder):
    os.makedirs(folder)
    for name, text in (("350m_zero3.json", json.dumps(TRAIN)), ("350m_zero3.log", "step 1 ...\n"),
                       ("calls.txt", "One call on two H200s: ZeRO-3 against FSDP2.\n"), ("gpus.txt", "NVIDIA H200\n")):
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


def test_a_packed_run_reads_as_it_did_and_packs_to_the_same_bytes(tmp_path):
    folder = str(tmp_path / "run99_test")
    _run(folder)
    loose = gpu_runs.read(folder)
    gpu_runs.pack(folder)
    assert sorted(os.listdir(folder)) == ["files.tar.xz", "summary.md"]
    assert gpu_runs.read(folder) == loose
    assert gpu_runs.train_jsons(folder) == [("350m_zero3", TRAIN)]
    text = open(os.path.join(folder, "summary.md")).read()
    # the run's own note, its GPU and its figures: tokens/s, the median of the steps after the
    # first, the largest CUDA peak
    for figure in ("ZeRO-3 against FSDP2", "NVIDIA H200", "123,456", "200.0 ms", "3.00 GiB", "dp 2, zero 3"):
        assert figure in text
    before = open(os.path.join(folder, "files.tar.xz"), "rb").read()
    gpu_runs.pack(folder)  # again: nothing loose to add, the same bytes
    assert open(os.path.join(folder, "files.tar.xz"), "rb").read() == before


def test_every_committed_run_has_its_summary_and_its_files():
    gpu = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results", "gpu")
    runs = sorted(d for d in os.listdir(gpu) if d.startswith("run"))
    assert runs
    for d in runs:
        assert sorted(os.listdir(os.path.join(gpu, d))) == ["files.tar.xz", "summary.md"], d
        assert gpu_runs.read(os.path.join(gpu, d)), d


def test_with_inductor_sets_the_options_and_refuses_an_unknown_one(tmp_path, capsys):
    """benchmarks/with_inductor.py (the GPU runs' Inductor experiments): each NAME=VALUE is
    set on torch._inductor.config before the command runs; a name Inductor has not is one
    line naming it, before anything runs."""
    import pytest
    import torch._inductor.config as inductor

    from benchmarks import with_inductor
    script = tmp_path / "probe.py"
    script.write_text("import sys, torch._inductor.config as c\nprint('combo', c.combo_kernels, sys.argv[1:])\n")
    before = inductor.combo_kernels
    try:
        assert with_inductor.main(["combo_kernels=True", "--", str(script), "x"]) == 0
        assert "combo True ['x']" in capsys.readouterr().out
    finally:
        inductor.combo_kernels = before
    with pytest.raises(SystemExit, match="has no option 'no_such_option'"):
        with_inductor.main(["no_such_option=1", "--", "train"])


def test_fidelity_takes_a_layouts_repeats_from_the_last_run_that_measured_it(tmp_path):
    """benchmarks/fidelity.py: runs of one layout in one call (`_2`, `_3` after the first)
    are one layout, judged on the median of their median steps; a later run folder that
    measured a layout replaces every run of it in an earlier one, repeats included."""
    from benchmarks import fidelity

    def write(folder, name, steps):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, name + ".json"), "w") as f:
            json.dump({**TRAIN, "throughput": {**TRAIN["throughput"], "step_times_s": steps}}, f)
    old, new = str(tmp_path / "run1"), str(tmp_path / "run2")
    write(old, "350m_single", [9.0, 1.0, 1.0])
    write(old, "350m_single_2", [9.0, 5.0, 5.0])
    write(old, "350m_single_4", [9.0, 4.0, 4.0])  # (a repeat the later run has not: dropped too)
    write(old, "1b_single", [9.0, 2.0, 2.0])
    write(new, "350m_single", [9.0, 0.3, 0.3])
    write(new, "350m_single_2", [9.0, 0.1, 0.1])
    write(new, "350m_single_3", [9.0, 0.25, 0.25])
    assert fidelity.layout_name("1b-moe_1gpu_2") == "1b-moe_1gpu" and fidelity.layout_name("1b_tp2-sp") == "1b_tp2-sp"
    runs = fidelity.latest_runs([old, new])
    assert sorted(runs) == ["1b_single", "350m_single"]
    folder, ms = runs["350m_single"]
    assert folder == new and len(ms) == 3
    assert runs["1b_single"][0] == old
    medians = sorted(fidelity.median(m["throughput"]["step_times_s"][1:]) for m in ms)
    assert medians == [0.1, 0.25, 0.3] and fidelity.median(medians) == 0.25


def test_a_device_profile_names_each_kernel_and_sums_its_time():
    from benchmarks import gpu_profile
    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "FusedOptimizerTensorListMetadata<4>, float>(int)")
    add = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
           "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)")
    impl = "std::enable_if<!(false), void>::type internal::gpu_kernel_impl<at::native::foo>(int)"
    assert gpu_profile.kernel(adam) == "at::native::anon::multi_tensor_apply_kernel"
    assert gpu_profile.kernel(add) == "at::native::vectorized_elementwise_kernel: CUDAFunctor_add"
    assert gpu_profile.kernel(impl) == "internal::gpu_kernel_impl"
    # two steps: the add twice a step (1 and 3 µs), AdamW once (10 µs)
    events = [(0, 1000, add), (2000, 5000, add), (6000, 16000, adam),
              (20000, 21000, add), (22000, 25000, add), (26000, 36000, adam)]
    table = gpu_profile.device_busy(events, last=2)
    lines = table.splitlines()
    assert "0.010 ms  at::native::anon::multi_tensor_apply_kernel" in lines[1] and lines[1].split()[0] == "1.0"
    assert "0.004 ms  at::native::vectorized_elementwise_kernel: CUDAFunctor_add" in lines[2]
    assert lines[2].split()[0] == "2.0"


def test_a_run_with_the_devices_steps_is_read_by_them(tmp_path):
    """A train JSON from a GPU holds the device's steps beside the host's
    (playground/device_steps.py): the summary's median step and fidelity's measured step are
    the device's, since a host that does not wait each step runs ahead of its device."""
    from benchmarks import fidelity
    folder = str(tmp_path / "run98_test")
    os.makedirs(folder)
    host = [1.0, 0.04, 0.04, 0.04]  # the host ran ahead: its steps are shorter than the device's
    device = [1.1, 0.05, 0.06, 0.05]
    d = {**TRAIN, "throughput": {**TRAIN["throughput"], "step_times_s": host, "device_step_times_s": device}}
    with open(os.path.join(folder, "350m_single.json"), "w") as f:
        json.dump(d, f)
    assert gpu_runs.step_times(d["throughput"]) == device
    assert gpu_runs.step_times(TRAIN["throughput"]) == TRAIN["throughput"]["step_times_s"]  # (runs before it)
    gpu_runs.pack(folder)
    assert "50.0 ms" in open(os.path.join(folder, "summary.md")).read()
    row = fidelity.compare("350m_single", folder, [d], "h200")
    assert row["measured_step_s"] == 0.05
