"""figures.tensor_parallel: chapter 8's split-MLP diagram and time bars."""

import pytest

from trainscale import figures
from trainscale.parallel import tensor_parallel_shapes


@pytest.mark.parametrize("shards", [1, 2, 8])
def test_diagram_draws_one_lane_per_device(shards):
    fig = figures.tensor_parallel_mlp_diagram(
        tensor_parallel_shapes(16, 8, 32, shards), "test", note="n"
    )
    lanes = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("device")]
    assert lanes == [f"device {i}" for i in range(shards)]


def test_time_bars_draw_and_reject_unknown_kinds():
    fig = figures.time_bars({"compute: a": 1.0, "communication: b": 2.0}, "t")
    assert len(fig.axes[0].patches) == 2
    with pytest.raises(ValueError, match="durations_ms"):
        figures.time_bars({"sleep: c": 1.0}, "t")


def test_activation_memory_bars_stack_split_and_whole_parts():
    fig = figures.activation_memory_bars({"TP": (52.0, 160.0), "TP + SP": (68.0, 0.0)}, 544.0, "t")
    widths = sorted(p.get_width() for p in fig.axes[0].patches)
    assert widths == [0.0, 52.0, 68.0, 160.0]  # two schemes, each split + whole
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "212 MiB" in labels and "68 MiB" in labels
    with pytest.raises(ValueError, match="kept"):
        figures.activation_memory_bars({}, 1.0, "t")
    with pytest.raises(ValueError, match="unsplit"):
        figures.activation_memory_bars({"TP": (1.0, 1.0)}, 0.0, "t")
