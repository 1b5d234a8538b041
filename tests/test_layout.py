"""Layout validation: clear errors naming the numbers that disagree and what would fit."""
import pytest

from model import preset
from playground import Layout, LayoutError


def test_world_and_dp_defaults():
    assert Layout.from_counts(world=8).dp == 8
    assert Layout.from_counts(world=8, tp=2).dp == 4
    assert Layout.from_counts(dp=2, tp=2, pp=2).world == 8
    assert Layout(dp=3, microbatches=2, micro_batch_size=4).global_batch == 24


@pytest.mark.parametrize("kw,message", [
    ({"world": 6, "tp": 4}, r"world=6 is not divisible by tp·pp·cp = 4"),
    ({"world": 6, "dp": 2, "tp": 2}, r"world=6 but pp·dp·cp·tp = 1·2·1·2 = 4"),
    ({"dp": 0}, r"--dp must be a positive integer, got 0"),
])
def test_from_counts_errors(kw, message):
    with pytest.raises(LayoutError, match=message):
        Layout.from_counts(**kw)


@pytest.mark.parametrize("layout,message", [
    (Layout(tp=3), r"n_heads=4 is not divisible by tp=3; tp could be one of \[1, 2, 4\]"),
    (Layout(pp=3), r"n_layers=2 is not divisible by pp·virtual_stages = 3·1 = 3"),
    (Layout(cp=3), r"seq_len=32 is not divisible by 2·cp = 6"),
    (Layout(pp=2, microbatches=3, schedule="interleaved", virtual_stages=1),
     r"interleaved 1F1B needs virtual stages v >= 2"),
    (Layout(pp=2, stage_layers=(1, 2)), r"stage_layers=\[1, 2\]: give 2 block counts .* summing to n_layers=2"),
    (Layout(pp=3, stage_layers=(1, 0, 1)), r"stage_layers=\[1, 0, 1\]: .* each positive but the first and the last"),
    (Layout(virtual_stages=2), r"virtual_stages=2 needs schedule='interleaved'"),
    (Layout(sequence_parallel=True), r"sequence_parallel needs tp > 1"),
    (Layout(ep=2, dp=2), r"ep=2 shards experts, and the model has none"),
    (Layout(zero=4, dp=2), r"zero=4: choose 0, 1, 2 or 3"),
    (Layout(schedule="zz"), r"schedule='zz': choose one of"),
])
def test_validate_errors(layout, message):
    with pytest.raises(LayoutError, match=message):
        layout.validate(preset("tiny"))
