"""Hybrid sharding (HSDP: ZeRO within dp_shard, its shards all-reduced across dp_replicate;
zero/zero.py): the same loss, gradients and weights as one device in float64, composed with
every other axis at sizes that are not powers of two; a replica that is not averaged fails
the check; the bytes per step follow the closed form, within a node and across nodes."""
import pytest

from collectives import launch
from model import GPT
from model.config import preset
from playground import Layout, RunConfig, check, train
from playground.data_parallel import zero_units
from zero.zero import unit_specs

TINY = preset("tiny")


def _check(layout, model=TINY, steps=2):
    return check(RunConfig(model=model, layout=layout, dtype="float64", steps=steps, progress=False))


@pytest.mark.parametrize("layout", [
    Layout(dp=6, dp_replicate=2, zero=3, microbatches=2),  # 3 shards × 2 replicas
    Layout(dp=6, dp_replicate=3, zero=2),  # 2 shards × 3 replicas
    Layout(dp=4, dp_replicate=2, zero=1, tp=2, sequence_parallel=True),
], ids=["shard3-rep2-zero3", "shard2-rep3-zero2", "hsdp-tp-sp"])
def test_hsdp_computes_what_one_device_computes(layout):
    rep = _check(layout)
    assert rep.passed, rep.worst()


@pytest.mark.parametrize("layout,model", [
    (Layout(dp=4, dp_replicate=2, zero=1, pp=2, microbatches=2), TINY),
    (Layout(dp=4, dp_replicate=2, zero=3, cp=2), TINY),
    (Layout(dp=6, dp_replicate=2, zero=2, ep=2), preset("tiny-moe")),
    (Layout(dp=3, dp_replicate=3, zero=1, tp=2, pp=2, microbatches=2, schedule="zb1"), TINY),
], ids=["hsdp-pp", "hsdp-cp", "hsdp-ep", "replicate-only-tp-pp-zb1"])
def test_hsdp_composes_with_every_axis(layout, model):
    rep = _check(layout, model)
    assert rep.passed, rep.worst()


@pytest.mark.sabotage
def test_the_check_catches_replicas_reduced_over_the_wrong_group(monkeypatch):
    """The shard's all-reduce sent over the shard group instead of across the replicas:
    each replica then updates with its own half of the batch's gradient."""
    import zero.zero
    real = zero.zero.ZeroDataParallel._finish_reduce

    def wrong(self, u):
        if self.replicate is not None:
            self.replicate = self.group  # (the sabotage: reduce over the wrong group)
        return real(self, u)
    monkeypatch.setattr(zero.zero.ZeroDataParallel, "_finish_reduce", wrong)
    rep = _check(Layout(dp=4, dp_replicate=2, zero=1), steps=1)
    assert not rep.passed


def _padded(n_shards: int) -> list:
    """Each ZeRO unit's flat length on the tiny model, padded to a multiple of the shards."""
    model = GPT(TINY, device="meta")
    return [-(-sum(p.numel() for _, p in ps) // n_shards) * n_shards
            for _, _, ps in unit_specs(model, zero_units(model))]


@pytest.mark.parametrize("stage", [1, 3])
def test_hsdp_bytes_per_step_follow_the_closed_form(stage):
    """Per rank per step, with S shards, R replicas and unit lengths padded to S (float32):
    reduce-scatter (S-1)/S of each unit within the shard group; all-reduce 2(R-1)/R of its
    shard across the replicas; all-gather (S-1)/S of it within the shard group after the
    step (stage 1), or twice per step around forward and backward (stage 3, units but the
    root: the root once more)."""
    S, R, width = 4, 2, 4
    res = train(RunConfig(model=TINY, layout=Layout(dp=S * R, dp_replicate=R, zero=stage), steps=2, progress=False))
    sent: dict = {}
    for e in res.ledger.per_rank[0]:
        if e.label.startswith("zero."):
            kind = e.label.split(".")[1]
            sent[kind] = sent.get(kind, 0) + e.bytes_sent / 2
    units = _padded(S)
    assert sent["grads"] == sum((S - 1) / S * n * width for n in units)
    assert sent["replicate"] == sum(2 * (R - 1) / R * n / S * width for n in units)
    gathered = sent["params"] if stage == 1 else sent["gather"]
    assert gathered >= sum((S - 1) / S * n * width for n in units) * (1 if stage == 1 else 2)
    groups = {e.label.split(".")[1]: e.group for e in res.ledger.per_rank[0] if e.label.startswith("zero.")}
    assert groups["grads"] == (0, 1, 2, 3) and groups["replicate"] == (0, 4)  # shards inside, replicas across


def test_the_mesh_splits_dp_into_replicate_and_shard_groups():
    layout = Layout(dp=8, dp_replicate=2, tp=2)

    def program(world):
        mesh = layout.mesh(world)
        return [tuple(mesh.group(*axes).ranks) for axes in (("dp",), ("dp_shard",), ("dp_replicate",), ("tp",))]
    res = launch(program, layout.world)
    assert res.values[0] == [tuple(range(0, 16, 2)), (0, 2, 4, 6), (0, 8), (0, 1)]
    assert res.values[11] == [tuple(range(1, 16, 2)), (9, 11, 13, 15), (3, 11), (10, 11)]


def test_hsdp_is_refused_without_zero_and_where_the_replicas_do_not_divide_dp(cli):
    status, _, err = cli("train", "--dp-shard", "2", "--dp-replicate", "2")
    assert status == 2 and "hybrid sharding replicates ZeRO's shards" in err
    status, _, err = cli("train", "--dp", "8", "--dp-shard", "3", "--zero", "1")
    assert status == 2 and "--dp-shard 3 does not divide dp=8" in err
    status, _, err = cli("train", "--dp", "6", "--dp-shard", "2", "--dp-replicate", "2", "--zero", "1")
    assert status == 2 and "--dp 6 but --dp-replicate 2 × --dp-shard 2 = 4" in err


def test_the_search_weighs_hybrid_sharding_where_dp_spans_nodes():
    from playground.search import candidates, model_states_bound
    cfg = preset("70b")
    layouts = candidates(cfg, 1024, 1024, 8, fixed={"tp": 2, "pp": 1})
    shards = {lay.dp_shard for lay in layouts if lay.dp_replicate > 1}
    assert shards == {4, 8, 16, 32, 64, 128, 256}  # the dp ranks of 1, 2, 4, ... 64 nodes at tp 2
    flat = Layout(dp=512, tp=2, zero=3)
    hybrid = Layout(dp=512, tp=2, zero=3, dp_replicate=128)
    assert model_states_bound(cfg, hybrid) > 100 * model_states_bound(cfg, flat)  # sharded over 4, not 512


def test_bytes_by_link_put_the_shard_group_on_nvlink_and_the_replicas_on_the_network():
    """dp 8 as 2 replicas × 4 shards on nodes of 4 GPUs: rank 0's reduce-scatters and
    all-gathers stay in its node, its all-reduces across replicas all leave it."""
    from playground.summary import link_classes
    res = train(RunConfig(model=TINY, layout=Layout(dp=8, dp_replicate=2, zero=1), steps=2, progress=False,
                          on_nan="off"))  # (the NaN check's all-reduce spans the world: left out here)
    by_kind: dict = {}
    for e in res.ledger.per_rank[0]:
        by_kind[e.label.split(".")[1]] = by_kind.get(e.label.split(".")[1], 0) + e.bytes_sent / 2
    classes = link_classes(res.ledger, 2, gpus_per_node=4)
    (within, across), = [(w, a) for ranks, w, a in classes if 0 in ranks]
    assert across == by_kind["replicate"]
    assert within == by_kind["grads"] + by_kind["params"] + by_kind["loss"]
    assert sum(len(r) for r, _, _ in classes) == 8


def test_sent_across_nodes_by_algorithm():
    from simulator.cost_model import sent_across_nodes
    S = 4096
    # a ring over ranks 0-7 on nodes of 4: rank 3 sends to 4 (another node), rank 2 to 3
    assert sent_across_nodes("all_reduce", "ring", S, range(8), 3, 7168, 4) == 7168
    assert sent_across_nodes("all_reduce", "ring", S, range(8), 2, 7168, 4) == 0
    # hierarchical over 2 nodes × 4: the inter-node all-reduce of S/k
    assert sent_across_nodes("all_reduce", "hierarchical", S, range(8), 5, 9999, 4) == 2 * 1 * (S // 4) // 2
    # inside one node nothing leaves it; a pipeline send to the next node all does
    assert sent_across_nodes("all_gather", "ring", S, range(4), 1, 3072, 4) == 0
    assert sent_across_nodes("send", "p2p", S, (3, 4), 3, S, 4) == S
