"""The simulated clock: overlap, idle time, point-to-point order, the
roofline time of an op, and DDP's exposed communication."""
import contextlib
import dataclasses
import pytest
import torch

from collectives import launch
from simulator.cost_model import collective_cost
from simulator import SimulatedTime
from simulator.hardware import PROFILES, load_hardware
from ddp import DistributedDataParallel
from model import GPT, preset

# calls cost the host nothing here, so each test sees only what it is about
# (test_a_call_costs_the_host_its_floor checks that cost)
H100 = dataclasses.replace(PROFILES["h100-datasheet"], collective_floor=0.0)
N = 4
S = 64 * 2**20  # bytes of the all-reduced tensor (meta: counted and timed, never moved)
COST = collective_cost("all_reduce", S, range(N), H100)[0]


def _overlap(world, compute):
    x = torch.empty(S // 4, device="meta")
    clock = world.timing.clock
    t0, e0 = clock.now, clock.exposed
    w = world.all_reduce(x, async_op=True)
    clock.advance(compute)
    w.wait()
    return clock.now - t0, clock.exposed - e0


@pytest.mark.parametrize("ratio", [0.5, 0.99, 1.5, 3.0])
def test_async_all_reduce_overlaps_compute(ratio):
    compute = COST * ratio
    res = launch(_overlap, N, args=(compute,), time_model=SimulatedTime(H100))
    for elapsed, exposed in res.values:
        # hidden when shorter than the compute; otherwise it adds exactly the difference
        assert elapsed == pytest.approx(max(compute, COST), rel=1e-12)
        assert exposed == pytest.approx(max(0.0, COST - compute), rel=1e-9, abs=1e-15)
    entries = [res.ledger.for_rank(r)[0] for r in range(N)]
    assert len({(e.start, e.end) for e in entries}) == 1
    assert entries[0].end - entries[0].start == pytest.approx(COST)


def test_a_collective_starts_when_its_last_member_arrives():
    def fn(world):
        world.timing.clock.advance(1e-3 * world.rank)  # rank r arrives r ms late
        world.all_reduce(torch.empty(S // 4, device="meta"))
        return world.timing.clock.breakdown()
    res = launch(fn, N, time_model=SimulatedTime(H100))
    last = 1e-3 * (N - 1)
    for r, b in enumerate(res.values):
        assert b["time"] == pytest.approx(last + COST)
        assert b["idle"] == pytest.approx(last - 1e-3 * r, abs=1e-15)
        assert b["exposed_comm"] == pytest.approx(COST)
        assert b["time"] == pytest.approx(b["compute"] + b["host"] + b["idle"] + b["exposed_comm"])


def test_a_call_costs_the_host_its_floor():
    """Issuing a collective costs the host the profile's call floor: from idle the call
    starts that much later; behind a long kernel (the host ahead) it costs nothing more."""
    hw = dataclasses.replace(PROFILES["h100-datasheet"], collective_floor=300e-6)
    a = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
    kernel = 2 * 8192 ** 3 / (hw.peak_bf16_flops * hw.matmul_fraction)
    assert kernel > 2 * hw.collective_floor

    def fn(world, busy):
        clock = world.timing.clock
        world.timing.compute_model.synchronize()
        t0 = clock.now
        if busy:
            a @ a
        world.all_reduce(torch.empty(S // 4, device="meta"))
        return clock.now - t0, clock.breakdown()
    cost = collective_cost("all_reduce", S, range(2), hw)[0]
    for (elapsed, b) in launch(fn, 2, args=(False,), time_model=SimulatedTime(hw)).values:
        assert elapsed == pytest.approx(hw.collective_floor + cost)
        assert b["host"] == pytest.approx(hw.collective_floor) and b["issuing"] == pytest.approx(hw.collective_floor)
    for (elapsed, b) in launch(fn, 2, args=(True,), time_model=SimulatedTime(hw)).values:
        assert elapsed == pytest.approx(hw.kernel_floor + kernel + cost)
        assert b["issuing"] == pytest.approx(hw.kernel_floor + hw.collective_floor)
    # a profile without collective_floor charges one kernel_floor per call
    assert PROFILES["h100-datasheet"].call_floor == PROFILES["h100-datasheet"].kernel_floor


def test_a_call_on_a_group_of_one_rank_costs_the_host_nothing():
    """The torch backend does a group of one rank's calls itself (no call reaches
    torch.distributed, none is in flight): a one-rank world's all-reduces add neither the
    call floor nor a wait for the device behind a long kernel, and the short ops after them
    keep the host's lead; the same calls on a two-rank world pay both."""
    hw = dataclasses.replace(PROFILES["h100-datasheet"], collective_floor=300e-6)
    a = torch.empty(8192, 8192, dtype=torch.bfloat16, device="meta")
    x = torch.empty(16, device="meta")

    def fn(world):
        clock = world.timing.clock
        world.timing.compute_model.synchronize()
        t0, i0, h0 = clock.now, clock.issuing, clock.host
        a @ a
        for _ in range(4):
            world.all_reduce(torch.empty(16, device="meta"), async_op=True).wait()
        for _ in range(20):
            x + 1
        return clock.now - t0, clock.issuing - i0, clock.host - h0
    kernel = 2 * 8192 ** 3 / (hw.peak_bf16_flops * hw.matmul_fraction)
    (alone, issuing, host), = launch(fn, 1, time_model=SimulatedTime(hw)).values
    assert issuing == pytest.approx(21 * hw.kernel_floor) and host == pytest.approx(hw.kernel_floor)
    assert kernel < alone - hw.kernel_floor < kernel + 20 * hw.kernel_floor  # the small ops issued during the kernel
    for elapsed, issuing, host in launch(fn, 2, time_model=SimulatedTime(hw)).values:
        assert issuing == pytest.approx(21 * hw.kernel_floor + 4 * hw.collective_floor)
        assert host > 10 * hw.kernel_floor  # behind the third call the host waited for the device
        assert elapsed > alone + 10 * hw.kernel_floor


def test_recv_completes_no_earlier_than_the_send():
    size = 8 * 2**20

    def fn(world):
        t = torch.empty(size // 4, device="meta")
        if world.rank == 0:
            world.timing.clock.advance(5e-6)
            world.send(t, 1)
        else:
            world.recv(t, 0)
        return world.timing.clock.now
    res = launch(fn, 2, time_model=SimulatedTime(H100))
    p2p = H100.nvlink_latency + size / H100.nvlink_bandwidth
    assert res.values == [pytest.approx(5e-6 + p2p), pytest.approx(5e-6 + p2p)]
    recv = res.ledger.for_rank(1)[0]
    assert recv.start == pytest.approx(5e-6) and recv.end == pytest.approx(5e-6 + p2p)


def test_op_time_is_the_roofline_of_its_flops_and_bytes_behind_the_host():
    """From host and device in step (after a value read on the host), one op costs the
    host's floor to issue it, then its roofline time on the device. The matmul's operands
    are meta tensors (priced as real ones; a 2048³ bf16 matmul computed on a CPU without
    bf16 instructions takes a minute), the value read a real one."""
    def fn(world, m, dtype):
        a, b = (torch.empty(m, m, dtype=dtype, device="meta") for _ in range(2))
        torch.zeros(1).item()
        t0 = world.timing.clock.now
        a @ b
        return world.timing.clock.now - t0
    for m in (64, 512, 2048):
        for dtype, peak in ((torch.float32, H100.fp32_flops), (torch.bfloat16, H100.peak_bf16_flops)):
            got = launch(fn, 1, args=(m, dtype), time_model=SimulatedTime(H100)).values[0]
            flops, nbytes = 2 * m ** 3, 3 * m * m * dtype.itemsize
            expect = H100.kernel_floor + max(flops / (peak * H100.matmul_fraction),
                                             nbytes / (H100.hbm_bandwidth * H100.hbm_fraction))
            assert got == pytest.approx(expect)
    # float32 runs at the FP32 peak
    fp32 = launch(fn, 1, args=(2048, torch.float32), time_model=SimulatedTime(H100)).values[0]
    bf16 = launch(fn, 1, args=(2048, torch.bfloat16), time_model=SimulatedTime(H100)).values[0]
    assert (fp32 - H100.kernel_floor) / (bf16 - H100.kernel_floor) == \
        pytest.approx(H100.peak_bf16_flops / H100.fp32_flops)


def test_host_and_device_are_two_queues():
    """Short ops issued while a long kernel runs cost only their device time (the host ran
    ahead); short ops issued one after another on an idle device cost the host's floor each."""
    def fn(world, first):
        a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
        x = torch.empty(16, device="meta")
        world.timing.compute_model.synchronize()  # as a value read on the host would
        t0 = world.timing.clock.now
        if first:
            a @ a
        for _ in range(10):
            x = x + 1
        return world.timing.clock.now - t0
    floor, add = H100.kernel_floor, 2 * 16 * 4 / (H100.hbm_bandwidth * H100.hbm_fraction)  # read x, write x + 1
    matmul = 2 * 4096 ** 3 / (H100.peak_bf16_flops * H100.matmul_fraction)
    assert matmul > 10 * floor
    behind = launch(fn, 1, args=(True,), time_model=SimulatedTime(H100)).values[0]
    assert behind == pytest.approx(floor + matmul + 10 * add)
    alone = launch(fn, 1, args=(False,), time_model=SimulatedTime(H100)).values[0]
    assert alone == pytest.approx(10 * floor + add)


def _sdpa(world, shape):
    """The simulated seconds of one causal SDPA call on q = k = v of `shape`."""
    q = torch.randn(*shape, dtype=torch.bfloat16)
    q[0, 0, 0, 0].item()
    t0 = world.timing.clock.now
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    return world.timing.clock.now - t0


def test_attention_runs_at_the_attention_fraction():
    got = launch(_sdpa, 1, args=((4, 8, 2048, 64),), time_model=SimulatedTime(H100)).values[0]
    flops = 4 * 4 * 8 * 2048 * 2048 * 64 * (2048 + 1) // (2 * 2048)  # QK^T and PV, causal half
    assert got == pytest.approx(H100.kernel_floor + flops / (H100.peak_bf16_flops * H100.attention_fraction), rel=1e-6)


def test_flashattention_1_kernels_run_at_half_the_profiles_attention_rate():
    """Inside `attention_kernels("flash1")` an SDPA call and a fused attention region cost
    twice their time at the profile's rate (FlashAttention-2 is about 2x FlashAttention-1:
    Dao 2023); "flash" and code outside the context keep it."""
    from model.regions import attention_kernels, fused_kernel

    def fn(world, generation):
        q = torch.randn(4, 8, 2048, 64, dtype=torch.bfloat16)
        m = torch.empty(1, 8, 1024, 64, device="meta")
        compute, clock = world.timing.compute_model, world.timing.clock
        with attention_kernels(generation) if generation else contextlib.nullcontext():
            compute.synchronize()
            t0 = clock.now
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            with fused_kernel(0, "flash_attention", attention=True):
                m @ m.transpose(-1, -2)
            return clock.now - t0
    one, two, outside = (launch(fn, 1, args=(g,), time_model=SimulatedTime(H100)).values[0]
                         for g in ("flash1", "flash", None))
    floor = H100.kernel_floor  # (the host issues the second kernel while the first runs)
    assert one - floor == pytest.approx(2 * (two - floor), rel=1e-9)
    assert outside == pytest.approx(two, rel=1e-12)


def test_an_optimizer_step_is_one_fused_pass():
    from model.regions import optimizer_kernel
    from zero.optimizer import adamw

    def fn(world, n):
        p = torch.nn.Parameter(torch.randn(n))
        opt = adamw([p])
        p.grad = torch.randn(n)
        with optimizer_kernel(opt):
            opt.step()  # the moments are made here: no time counted for the first
        p[0].item()
        t0 = world.timing.clock.now
        with optimizer_kernel(opt):
            opt.step()
        return world.timing.clock.now - t0
    for n in (1000, 10_000_000):
        got = launch(fn, 1, args=(n,), time_model=SimulatedTime(H100)).values[0]
        assert got == pytest.approx(H100.kernel_floor + 7 * 4 * n / (H100.hbm_bandwidth * H100.hbm_fraction))


def test_without_a_profile_nothing_is_timed():
    def fn(world):
        world.all_reduce(torch.ones(4))
        return world.timing
    res = launch(fn, 2)
    assert res.values == [None, None] and res.ledger.for_rank(0)[0].start is None and res.time_model is None


def _ddp_exposed(world, bucket_mb, batch):
    cfg = preset("small", n_layers=2, seq_len=64)
    model = GPT(cfg, seed=0)
    ddp = DistributedDataParallel(model, world, bucket_cap_mb=bucket_mb)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1))
    before = world.timing.clock.breakdown()
    ddp(x[:, :-1], x[:, 1:]).backward()
    after = world.timing.clock.breakdown()
    return {k: after[k] - before[k] for k in after}


# (compute beside communication not slowed: this is about hiding it; the contention has its own test)
A100 = dataclasses.replace(load_hardware("a100-80gb"), overlap_slowdown=0.0)


def _exposed(bucket_mb, batch, hardware=A100):
    return launch(_ddp_exposed, 4, args=(bucket_mb, batch), time_model=SimulatedTime(hardware)).values[0]


@pytest.mark.slow
def test_ddp_buckets_hide_communication_behind_backward():
    """With a backward long enough, buckets reduced during it leave only the last one
    exposed; with a short backward, many small buckets pay 2(p-1)·α each and lose."""
    one, five = _exposed(1000.0, 32), _exposed(0.5, 32)
    assert five["compute"] == pytest.approx(one["compute"])  # same work, different overlap
    assert five["exposed_comm"] < one["exposed_comm"] / 2
    # (the host issues every bucket's kernels, a floor each: this model's backward is short
    # enough for that to show, so the device's time is compared without its host stalls)
    assert five["time"] - five["host"] < one["time"] - one["host"]
    # (without the kernel floor, which alone makes this small model's backward long)
    no_floor = dataclasses.replace(A100, kernel_floor=0.0)
    short_one, short_many = _exposed(1000.0, 4, no_floor), _exposed(0.1, 4, no_floor)
    assert short_many["exposed_comm"] > short_one["exposed_comm"]


def test_trace_covers_compute_and_every_call():
    from simulator.trace import chrome_trace

    def fn(world):
        x = torch.randn(128, 128)
        for _ in range(3):
            w = world.all_reduce(x @ x, async_op=True, label="grads")
            x @ x
            w.wait()
    res = launch(fn, 3, time_model=SimulatedTime(H100))
    trace = chrome_trace(res.ledger, res.time_model.clocks)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for r, clock in enumerate(res.time_model.clocks):
        compute = [e for e in spans if e["pid"] == r and e["tid"] == 0]
        assert sum(e["dur"] for e in compute) == pytest.approx((clock.compute + clock.host) * 1e6)  # (with host stalls)
        comm = [e for e in spans if e["pid"] == r and e["tid"] == 1]
        assert [(e["ts"], e["dur"]) for e in comm] == [
            (pytest.approx(e.start * 1e6), pytest.approx((e.end - e.start) * 1e6)) for e in res.ledger.for_rank(r)]
    with pytest.raises(ValueError, match="no simulated times"):
        chrome_trace(launch(fn, 2).ledger, [res.time_model.clocks[0]] * 2)


def test_the_ledger_records_the_algorithm_the_cost_model_chose():
    def fn(world):
        world.all_reduce(torch.empty(2, device="meta"), label="small")
        world.all_reduce(torch.empty(2**26, device="meta"), label="big")
    small = 8  # bytes
    big = 2**28
    res = launch(fn, 16, time_model=SimulatedTime(H100))  # two nodes of eight
    for r in range(16):
        e = {x.label: x for x in res.ledger.for_rank(r)}
        assert e["small"].algorithm == "recursive_doubling"
        assert e["small"].bytes_sent == e["small"].bytes_recv == 4 * small  # log2(16) exchanges of S
        assert e["big"].algorithm == "hierarchical"
        k, m = 8, 2
        assert e["big"].bytes_sent == 2 * (k - 1) * big // k + 2 * (m - 1) * (big // k) // m
    # without a profile the ledger keeps the ring
    plain = launch(fn, 16).ledger.for_rank(0)
    assert [x.algorithm for x in plain] == ["ring", "ring"]
    assert plain[1].bytes_sent == 2 * 15 * big // 16


@pytest.mark.parametrize("axes", [{"dp": 3}, pytest.param({"dp": 3, "zero": 3}, marks=pytest.mark.slow),
                                  pytest.param({"dp": 2, "pp": 2, "schedule": "zb1"}, marks=pytest.mark.slow)])
def test_replayed_steps_match_steps_counted_op_by_op(axes):
    """Step 1 recorded, steps 2.. replayed with op counting off: every rank's simulated
    step (compute, exposed communication, idle) and memory equal counting every op (DDP,
    ZeRO-3 with its gathers and prefetches, a pipeline with its sends and receives)."""
    from playground import Layout, RunConfig
    from playground.training import train

    def run(every):
        cfg = preset("tiny", n_layers=2)
        return train(RunConfig(model=cfg, layout=Layout(**axes, micro_batch_size=2, microbatches=2), steps=4,
                               progress=False, hardware="h100-sxm", bucket_cap_mb=0.01, count_every_step=every))
    counted, replayed = run(True), run(False)
    assert counted.losses == replayed.losses
    for a, b in zip(counted.values, replayed.values):
        assert len(a["sim_steps"]) == 4
        for sa, sb in zip(a["sim_steps"][1:], b["sim_steps"][1:]):
            assert sb == {k: pytest.approx(v, rel=1e-9, abs=1e-15) for k, v in sa.items()}
            assert sb["exposed_comm"] > 0 and sb["compute"] > 0
        assert a["memory"] == b["memory"]
    for ca, cb in zip(counted.clocks, replayed.clocks):
        assert cb.now == pytest.approx(ca.now, rel=1e-9)
    ents = lambda res: [(e.label, e.start, e.end) for e in res.ledger.for_rank(1)]  # noqa: E731
    for (la, sa, ea), (lb, sb, eb) in zip(ents(counted), ents(replayed)):
        assert la == lb and sb == pytest.approx(sa, rel=1e-9) and eb == pytest.approx(ea, rel=1e-9)


def test_a_step_that_does_not_repeat_the_recorded_one_is_refused():
    from collectives import RankFailedError
    from simulator.clock import ReplayMismatchError

    def fn(world):
        timing = world.timing.compute_model
        for step, n in enumerate((1, 1, 2)):  # the third step makes one more call
            with timing.step("record" if step == 1 else "replay" if step == 2 else None):
                for _ in range(n):
                    world.all_reduce(torch.ones(4) @ torch.ones(4, 4))
    with pytest.raises(RankFailedError, match="recorded step had 'end of step' here"):
        launch(fn, 2, time_model=SimulatedTime(H100))

    def sizes(world):  # same calls, but the third step's tensor is larger (data-dependent sizes, as in MoE)
        timing = world.timing.compute_model
        for step, n in enumerate((4, 4, 6)):
            with timing.step("record" if step == 1 else "replay" if step == 2 else None):
                world.all_reduce(torch.ones(n), label="tokens")
    with pytest.raises(RankFailedError, match=r"\(4,\).*this step has.*\(6,\)"):
        launch(sizes, 2, time_model=SimulatedTime(H100))
    with pytest.raises(ReplayMismatchError, match="only after one was recorded"):
        from simulator.clock import RankClock
        RankClock().begin_step("replay")


def test_an_uneven_all_to_all_lasts_as_long_as_its_largest_message():
    """Rank 0 sends 1 row to each peer, rank 1 sends 1000: both wait for the larger exchange."""
    def fn(world):
        n = 1 if world.rank == 0 else 1000
        inp = torch.empty(2 * n, 256, device="meta")
        out = torch.empty(n + (1000 if world.rank == 0 else 1), 256, device="meta")
        theirs = 1000 if world.rank == 0 else 1
        world.all_to_all(out, inp, out_splits=[n, theirs] if world.rank == 0 else [theirs, n],
                         in_splits=[n, n], label="uneven")
        e = world.timing.clock.breakdown()
        return e["time"]
    res = launch(fn, 2, time_model=SimulatedTime(H100))
    entries = [res.ledger.for_rank(r)[0] for r in range(2)]
    big = max(e.size for e in entries)
    cost, _ = collective_cost("all_to_all", big, (0, 1), H100)
    for e in entries:
        assert e.end - e.start == pytest.approx(cost)
    assert res.values[0] == pytest.approx(res.values[1])


def test_the_host_runs_at_most_two_waited_calls_ahead(monkeypatch):
    """As the torch backend bounds its run-ahead: at a third waited call the host waits
    until the device has passed the first, so its lead from a long kernel is lost and the
    short ops after it stall the device."""
    import simulator.clock as clock_module

    def run():
        c = clock_module.RankClock()
        c.begin_step(None)
        c.launch(1.0, 100.0)  # issued at 1, done at 101
        for _ in range(3):
            c.wait(c.now, c.now + 10.0)  # the device passes them at 111, 121, 131
        for _ in range(30):
            c.launch(2.0, 0.5)
        return c.now, c.host
    # the host resumes at 111: ops issued at 113, 115, ... overtake the device from the 14th
    assert run() == (pytest.approx(111 + 2 * 30 + 0.5), pytest.approx(111 + 60.5 - 131 - 15 + 1.0))
    monkeypatch.setattr(clock_module, "MAX_IN_FLIGHT", 1000)
    assert run() == (pytest.approx(131 + 30 * 0.5), pytest.approx(1.0))


def test_a_fused_attention_region_runs_at_the_attention_rate():
    """Ring attention writes its blocks as float32 matmuls inside `fused_kernel` (one
    FlashAttention call on a GPU): their FLOPs are priced at the attention rate, not FP32's."""
    from model.regions import fused_kernel

    def fn(world):
        q = torch.empty(1, 8, 1024, 64, device="meta")
        world.timing.compute_model.synchronize()
        t0 = world.timing.clock.now
        with fused_kernel(0, "flash_attention", attention=True):
            q @ q.transpose(-1, -2)
        return world.timing.clock.now - t0
    got = launch(fn, 1, time_model=SimulatedTime(H100)).values[0]
    flops = 2 * 8 * 1024 * 1024 * 64
    assert got == pytest.approx(H100.kernel_floor + flops / (H100.peak_bf16_flops * H100.attention_fraction))


def test_outputs_made_without_the_meta_kernel_are_the_kernels():
    """Plans skip the meta kernels (torch's Python references) of common pointwise ops and
    reductions: the outputs made instead have the kernel's shape, strides and dtype, and
    every case outside the rule runs the kernel."""
    from simulator.compute_model import _on_meta
    aten = torch.ops.aten
    made = 0
    for dtype in (torch.float32, torch.bfloat16):
        def t(*shape, dt=dtype):
            return torch.empty(shape, dtype=dt, device="meta")
        cases = [(aten.add.Tensor, (t(2, 3, 4), t(2, 3, 4)), {}), (aten.add.Tensor, (t(2, 3, 4), t(4)), {"alpha": 2}),
                 (aten.mul.Tensor, (t(2, 1, 4), t(3, 1)), {}), (aten.mul.Tensor, (t(5, 6), 0.5), {}),
                 (aten.sub.Tensor, (t(2, 3, 1), t(2, 3, 4)), {}), (aten.div.Tensor, (t(7,), 3), {}),
                 (aten.neg.default, (t(3, 2),), {}), (aten.rsqrt.default, (t(2, 5, 1),), {}),
                 (aten.silu.default, (t(4, 8),), {}), (aten.sigmoid.default, (t(4, 8),), {}),
                 (aten.exp.default, (t(3,),), {}), (aten.pow.Tensor_Scalar, (t(2, 9), 2), {}),
                 (aten.silu_backward.default, (t(4, 8), t(4, 8)), {}),
                 (aten.sigmoid_backward.default, (t(4, 8), t(4, 8)), {}),
                 (aten.roll.default, (t(2, 3, 8), [4], [-1]), {}),
                 (aten.mean.dim, (t(2, 3, 8), [-1], True), {}), (aten.mean.dim, (t(2, 3, 8), [0, 2]), {}),
                 (aten.sum.dim_IntList, (t(2, 3, 8), [1]), {}), (aten.sum.dim_IntList, (t(2, 3, 8), [-3, -1], True), {}),
                 # outside the rule: the kernel runs
                 (aten.add.Tensor, (t(2, 3), t(2, 3, dt=torch.float64)), {}), (aten.mul.Tensor, (t(2, 3), t()), {}),
                 (aten.mul.Tensor, (t(3, 2).t(), t(2, 3)), {}), (aten.mul.Tensor, (t(2, 3), True), {}),
                 (aten.add.Tensor, (t(2, 3, dt=torch.int64), 1), {}), (aten.sum.dim_IntList, (t(2, 3), []), {}),
                 (aten.sum.dim_IntList, (t(2, 3), [0]), {"dtype": torch.float64}),
                 (aten.add.Tensor, (t(2, 3), torch.empty(2, 3)), {})]
        for func, args, kwargs in cases:
            got = _on_meta(func, args, kwargs)
            try:
                want = func(*args, **kwargs)
            except RuntimeError:  # (a meta and a CPU tensor: the kernel's error stays)
                assert got is None
                continue
            if got is not None:
                made += 1
                assert (got.shape, got.stride(), got.dtype, got.device) == (want.shape, want.stride(), want.dtype,
                                                                             want.device), (func, args)
    assert made == 2 * 19


def test_grouped_gemm_experts_are_priced_by_their_flops():
    """The experts as grouped GEMMs on meta (what a plan prices for a bf16 GPU run): forward
    three (M, d) × (E, d, f) products, 2·M·d·f FLOPs each, and twice that in backward (the
    input's gradient and the weights', whose groups split the M rows)."""
    from model.moe import Experts

    def fn(world):
        experts = Experts(4, 64, 96).to(device="meta", dtype=torch.bfloat16)
        x = torch.empty(40, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        compute = world.timing.compute_model
        before = compute.flops
        y = experts(x, torch.tensor([10, 0, 20, 10]))
        y.backward(torch.empty_like(y))
        return compute.flops - before
    got = launch(fn, 1, time_model=SimulatedTime(H100)).values[0]
    assert got == 3 * 3 * 2 * 40 * 64 * 96


def _beside(world, compute, blocking):
    x = torch.empty(S // 4, device="meta")
    clock = world.timing.clock
    t0, e0 = clock.now, clock.exposed
    w = world.all_reduce(x, async_op=not blocking)
    clock.advance(compute)
    if not blocking:
        w.wait()
    return clock.now - t0, clock.exposed - e0, clock.contention


@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_compute_beside_a_call_runs_slower_by_the_profiles_overlap_slowdown(ratio):
    """Compute overlapping a call in flight is stretched by the profile's overlap_slowdown
    times the overlap (Lee et al. 2025); compute after a blocking call is not."""
    hw, compute = dataclasses.replace(H100, overlap_slowdown=0.25), COST * ratio
    for elapsed, exposed, contention in launch(_beside, N, args=(compute, False), time_model=SimulatedTime(hw)).values:
        stretched = compute + 0.25 * min(compute, COST)
        assert contention == pytest.approx(0.25 * min(compute, COST))
        assert elapsed == pytest.approx(max(stretched, COST))
        assert exposed == pytest.approx(max(0.0, COST - stretched), abs=1e-15)
    for elapsed, exposed, contention in launch(_beside, N, args=(compute, True), time_model=SimulatedTime(hw)).values:
        assert contention == 0.0 and elapsed == pytest.approx(COST + compute)


def test_a_matmul_runs_in_whole_tiles_and_waves():
    """Tile and wave quantization (the profile's sm_count and matmul_tiles): an output of
    exactly one wave of tiles runs at the matmul rate; one more row starts a second wave."""
    hw = load_hardware("h100-sxm")
    assert hw.sm_count == 132
    assert hw.wave_quantization(128 * 12, 256 * 11) == 1.0  # 132 tiles of 128 × 256
    assert hw.wave_quantization(128 * 12 + 1, 256 * 11) > 1.3
    assert hw.wave_quantization(16384, 16384) == pytest.approx(1.0, abs=0.02)  # many waves: little lost
    assert dataclasses.replace(hw, sm_count=None).wave_quantization(128 * 12 + 1, 256 * 11) == 1.0

    def fn(world, m):
        a = torch.empty(m, 4096, dtype=torch.bfloat16, device="meta")
        b = torch.empty(4096, 256 * 11, dtype=torch.bfloat16, device="meta")
        world.timing.compute_model.synchronize()
        t0 = world.timing.clock.now
        a @ b
        return world.timing.clock.now - t0
    one, more = (launch(fn, 1, args=(m,), time_model=SimulatedTime(hw)).values[0] for m in (128 * 12, 128 * 12 + 1))
    flops = 2 * 128 * 12 * 4096 * 256 * 11
    assert one == pytest.approx(hw.kernel_floor + flops / (hw.peak_bf16_flops * hw.matmul_fraction), rel=1e-9)
    assert more - hw.kernel_floor > 1.3 * (one - hw.kernel_floor)


def test_attention_runs_at_the_measured_fraction_for_its_shape(tmp_path):
    """A profile's attention_table: interpolated in log(sequence) at the nearest measured head
    dimension, flat beyond its ends; a profile file holds it and reads it back."""
    import json
    table = {64: ((1024, 0.2), (4096, 0.4)), 128: ((1024, 0.3), (4096, 0.5))}
    hw = dataclasses.replace(H100, attention_table=table)
    assert hw.attention_fraction_at(128, 2048) == pytest.approx(0.4)  # halfway in log2
    assert hw.attention_fraction_at(128, 512) == 0.3 and hw.attention_fraction_at(128, 8192) == 0.5
    assert hw.attention_fraction_at(64, 1024) == 0.2 and hw.attention_fraction_at(80, 4096) == 0.4
    assert dataclasses.replace(hw, attention_table=None).attention_fraction_at(64, 1024) == H100.attention_fraction
    (tmp_path / "hw.json").write_text(json.dumps(hw.to_dict()))
    assert load_hardware(str(tmp_path / "hw.json")).attention_table == table
    got = launch(_sdpa, 1, args=((1, 8, 2048, 128),), time_model=SimulatedTime(hw)).values[0]
    flops = 4 * 8 * 2048 * 2048 * 128 * (2048 + 1) // (2 * 2048)
    assert got == pytest.approx(hw.kernel_floor + flops / (hw.peak_bf16_flops * 0.4), rel=1e-6)


def test_marked_regions_do_not_break_a_graph_torch_compile_traces():
    """`--compile` traces each block whole: the regions marked for the simulator (one fused
    kernel, the optimizer's, a pipeline action) read no mode stack there, where reading it
    splits the block into several graphs (each one's host cost paid per call)."""
    import torch._dynamo
    from model.compiled import fused_on
    from model.regions import fused_kernel, optimizer_kernel, pipeline_action

    def marked(x):
        with fused_kernel(64, "moe_layer"), pipeline_action("F"), optimizer_kernel(None):
            y = fused_on(torch.sin, x)(x)  # (as it is inside the caller's graph)
        return y * 2 + 1

    torch._dynamo.reset()
    explained = torch._dynamo.explain(marked)(torch.randn(8))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _chain(x, w):
    y = x @ w
    for _ in range(6):
        y = torch.sigmoid(y) * y + y
    return y


def test_a_compiled_regions_backward_costs_the_host_one_call():
    """A region a GPU runs through torch.compile (model.compiled.region) has its backward
    compiled too: on the meta device its backward ops cost the device what each costs alone,
    back to back, what it recomputes from the forward nothing (fused into its consumers: the
    same device time as the eager backward here), and the host one call, where priced op by
    op the host pays a floor for every op. The forward is the one fused kernel either way;
    gradients on the CPU are the function's own."""
    from model.compiled import region
    from model.regions import fused_kernel

    def fn(world, compiled):
        x = torch.empty(512, 512, dtype=torch.bfloat16, device="meta", requires_grad=True)
        w = torch.empty(512, 512, dtype=torch.bfloat16, device="meta", requires_grad=True)
        if compiled:
            y = region("chain", 4 * x.nbytes, _chain, x, w)
        else:
            with fused_kernel(4 * x.nbytes, "chain"):
                y = _chain(x, w)
        world.timing.compute_model.synchronize()
        clock = world.timing.clock
        t0, c0, i0, k0 = clock.now, clock.compute, clock.issuing, world.timing.compute_model.kernels
        y.backward(torch.empty_like(y))
        return clock.compute - c0, clock.issuing - i0, world.timing.compute_model.kernels - k0, x.grad.shape
    compiled = launch(fn, 1, args=(True,), time_model=SimulatedTime(H100)).values[0]
    eager = launch(fn, 1, args=(False,), time_model=SimulatedTime(H100)).values[0]
    assert compiled[0] == pytest.approx(eager[0], rel=1e-9)  # the same device time
    assert eager[2] > 20 and compiled[2] == 1  # every backward op a launch, against the graph's one call
    assert eager[1] == pytest.approx(eager[2] * H100.kernel_floor) and compiled[1] == pytest.approx(H100.kernel_floor)
    assert compiled[3] == eager[3] == (512, 512)
    # on the CPU the region is the function, op by op: its gradients exactly
    x, w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True), torch.randn(8, 8, dtype=torch.float64)
    w.requires_grad_()
    g = torch.autograd.grad(region("chain", 0, _chain, x, w).sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(g, torch.autograd.grad(_chain(x, w).sum(), (x, w))))


def test_a_value_read_from_a_meta_tensor_waits_for_the_device_and_reads_zero():
    """A plan's host read (an fp16 overflow flag's `.item()` on the meta device): the value
    reads as zero, and the host waits for the device as a real read does, so the ops after it
    are issued one floor apart on an idle device instead of queueing behind the matmul."""
    def fn(world, read):
        a = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
        x = torch.empty(16, device="meta")
        world.timing.compute_model.synchronize()
        t0 = world.timing.clock.now
        a @ a
        value = x[:1].sum().item() if read else None
        for _ in range(10):
            x = x + 1
        return world.timing.clock.now - t0, value
    floor = H100.kernel_floor
    matmul = 2 * 4096 ** 3 / (H100.peak_bf16_flops * H100.matmul_fraction)
    behind, _ = launch(fn, 1, args=(False,), time_model=SimulatedTime(H100)).values[0]
    waited, value = launch(fn, 1, args=(True,), time_model=SimulatedTime(H100)).values[0]
    assert value == 0.0 and behind < floor + matmul + 10 * floor
    assert waited >= floor + matmul + 10 * floor
