"""The alpha-beta cost model against the closed forms, placement on nodes, algorithm
choice, and hardware profiles."""
import json
import math

import pytest

from simulator.cost_model import collective_cost, placement
from simulator.hardware import PROFILES, load_hardware

H100 = PROFILES["h100-datasheet"]
A_NV, B_NV = H100.nvlink_latency, 1 / H100.nvlink_bandwidth
A_NET, B_NET = H100.network_latency, 1 / H100.network_bandwidth


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("S", [2**20, 2**30])
def test_ring_and_friends_inside_a_node(p, S):
    ranks = list(range(p))
    t, algo = collective_cost("all_reduce", S, ranks, H100, algorithm="ring")
    assert algo == "ring" and t == pytest.approx(2 * (p - 1) * A_NV + 2 * (p - 1) / p * S * B_NV)
    for op in ("all_gather", "reduce_scatter"):
        t, algo = collective_cost(op, S, ranks, H100)
        assert algo == "ring" and t == pytest.approx((p - 1) * A_NV + (p - 1) / p * S * B_NV)
    t, algo = collective_cost("all_to_all", S, ranks, H100)
    assert algo == "pairwise" and t == pytest.approx((p - 1) * A_NV + (p - 1) / p * S * B_NV)
    t, algo = collective_cost("all_reduce", S, ranks, H100, algorithm="recursive_doubling")
    steps = math.ceil(math.log2(p))
    assert algo == "recursive_doubling" and t == pytest.approx(steps * A_NV + steps * S * B_NV)
    t, algo = collective_cost("broadcast", S, ranks, H100)
    assert algo == "chain" and t == pytest.approx((p - 1) * A_NV + S * B_NV)


def test_auto_takes_recursive_doubling_for_small_messages_and_ring_for_large():
    ranks = list(range(8))
    assert collective_cost("all_reduce", 8, ranks, H100)[1] == "recursive_doubling"
    assert collective_cost("all_reduce", 2**28, ranks, H100)[1] == "ring"


def test_links_follow_placement():
    assert placement(range(8), 8) == (1, 8, True)
    assert placement([0, 8, 16], 8) == (3, 1, True)
    assert placement(range(16), 8) == (2, 8, True)
    assert placement([0, 1, 8], 8) == (2, 2, False)
    S = 2**26
    t, algo = collective_cost("all_gather", S, [0, 8, 16, 24], H100)  # one rank per node: network
    assert algo == "ring" and t == pytest.approx(3 * A_NET + 3 / 4 * S * B_NET)
    t, _ = collective_cost("send", S, [3, 11], H100)
    assert t == pytest.approx(A_NET + S * B_NET)
    t, _ = collective_cost("send", S, [3, 4], H100)
    assert t == pytest.approx(A_NV + S * B_NV)


def test_hierarchical_across_nodes():
    S, m, k = 2**28, 4, 8  # 32 ranks on 4 nodes of 8
    ranks = list(range(32))
    t, algo = collective_cost("all_reduce", S, ranks, H100)
    expect = 2 * ((k - 1) * A_NV + (k - 1) / k * S * B_NV) + 2 * (m - 1) * A_NET + 2 * (m - 1) / m * (S / k) * B_NET
    assert algo == "hierarchical" and t == pytest.approx(expect)
    flat = 2 * 31 * A_NET + 2 * 31 / 32 * S * B_NET
    assert t < flat / 3  # the network carries S/k per GPU instead of ~2S
    t, algo = collective_cost("all_gather", S, ranks, H100)
    assert algo == "hierarchical"
    assert t == pytest.approx((m - 1) * A_NET + (m - 1) / m * (S / k) * B_NET + (k - 1) * A_NV + (k - 1) / k * S * B_NV)
    # irregular: a flat ring over the network
    t, algo = collective_cost("all_reduce", S, [0, 1, 8], H100, algorithm="ring")
    assert algo == "ring" and t == pytest.approx(2 * 2 * A_NET + 2 * 2 / 3 * S * B_NET)


def test_trivial_groups_cost_nothing():
    assert collective_cost("all_reduce", 2**20, [5], H100) == (0.0, "none")
    t, algo = collective_cost("barrier", 0, range(8), H100)
    assert algo == "recursive_doubling" and t == pytest.approx(3 * A_NV)


def test_profiles_and_files(tmp_path):
    # the h100 is the shipped profile, each number cited in its sources (simulator/profiles/h100-sxm.json)
    h100 = load_hardware("h100")
    assert h100.name == "h100-sxm" and h100.sm_count == 132 and h100.attention_table and h100.matmul_fraction == 0.7
    assert load_hardware("h100-datasheet") is PROFILES["h100-datasheet"]
    h200 = load_hardware("h200-datasheet")
    assert h200.hbm_capacity == 141e9 and h200.peak_bf16_flops == H100.peak_bf16_flops
    # the calibrated h200 keeps the datasheet's peak and takes the device's memory (torch's total_memory)
    calibrated = load_hardware("h200")
    assert calibrated.peak_bf16_flops == h200.peak_bf16_flops and 139 * 2**30 < calibrated.hbm_capacity < 141 * 2**30
    # and the shapes measured on an H200: attention by head dimension and sequence, tiles on its 132 SMs
    assert calibrated.attention_fraction_at(128, 8192) > 1.5 * calibrated.attention_fraction and calibrated.sm_count == 132
    assert load_hardware("a100-80gb").nvlink_bandwidth == 232e9  # NCCL's bus bandwidth on 8 A100s
    custom = {**H100.to_dict(), "name": "mine", "gpus_per_node": 4, "network_bandwidth": 12.5e9,
              "collective_floor": 1e-4}  # (optional: without it a call costs the host one kernel_floor)
    (tmp_path / "hw.json").write_text(json.dumps(custom))
    (tmp_path / "hw.toml").write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in custom.items()))
    for name in ("hw.json", "hw.toml"):
        hw = load_hardware(str(tmp_path / name))
        assert hw.name == "mine" and hw.gpus_per_node == 4 and hw.network_bandwidth == 12.5e9
        assert hw.call_floor == 1e-4
    del custom["hbm_capacity"]
    (tmp_path / "bad.json").write_text(json.dumps(custom))
    with pytest.raises(ValueError, match=r"missing \['hbm_capacity'\]"):
        load_hardware(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="not a profile"):
        load_hardware("tpu-v9")


def test_small_all_reduce_across_nodes_takes_recursive_doubling():
    t, algo = collective_cost("all_reduce", 8, range(16), H100)
    assert algo == "recursive_doubling" and t == pytest.approx(4 * A_NET + 4 * 8 * B_NET)
    assert collective_cost("all_reduce", 8, range(16), H100, algorithm="hierarchical")[1] == "hierarchical"
