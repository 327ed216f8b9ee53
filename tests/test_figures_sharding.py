"""figures.sharding: ZeRO's memory bars and the FSDP timeline of chapter 7."""

import pytest

from trainscale import figures
from trainscale.sharding import fsdp_memory_moments, fsdp_moments


def test_figures_draw():
    parts = {"weights": 1.0, "gradients": 1.0, "optimiser state": 6.0}
    fig = figures.zero_stage_bars({"DDP": parts, "ZeRO-1": parts}, 74.5, "test")
    assert len(fig.axes[0].patches) == 6
    fig = figures.fsdp_timeline(fsdp_moments(3), ["a", "b", "c"], upto=2)
    assert fig.axes[0].get_title().startswith("One FSDP step")
    with pytest.raises(ValueError, match="upto"):
        figures.fsdp_timeline(fsdp_moments(3), ["a", "b", "c"], upto=7)


def test_memory_timeline_and_accumulation_traffic_draw():
    moments = fsdp_memory_moments([[(4, 2)], [(3,)]], 2, rank=1)
    totals = [m.total for m in moments]
    fig = figures.fsdp_memory_timeline({"a": (moments, totals)}, ["u0", "u1"], "test")
    assert len(fig.axes) == 1 and len(fig.axes[0].patches) == 5 * len(moments)
    assert fig.axes[0].get_ylabel() == "MiB held"  # the book's binary units (issue #25)
    with pytest.raises(ValueError, match="measured"):
        figures.fsdp_memory_timeline({"a": (moments, totals[:2])}, ["u0", "u1"], "test")
    with pytest.raises(ValueError, match="panels"):
        figures.fsdp_memory_timeline({}, ["u0"], "test")
    fig = figures.zero_accumulation_traffic(
        [1, 2, 4], {"DDP": [2, 2, 2], "ZeRO-3": [3, 6, 12]}, {"ZeRO-3": [3, 6, 12]}, "t"
    )
    assert fig.axes[0].get_ylabel() == "bytes per step / DDP's"
    with pytest.raises(ValueError, match="first setup"):
        figures.zero_accumulation_traffic([1], {"DDP": [0]}, {}, "t")


def test_a_long_memory_timeline_title_is_wrapped_inside_the_figure():
    # Issue #25: the chapter's title was clipped at both ends of the figure.
    moments = fsdp_memory_moments([[(4, 2)], [(3,)]], 2, rank=0)
    totals = [m.total for m in moments]
    title = "What rank 0 holds at each moment of a step (bars: model; dots: measured)"
    fig = figures.fsdp_memory_timeline({"a": (moments, totals)}, ["u0", "u1"], title)
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent()
    width = fig.get_window_extent().width
    assert "\n" in fig._suptitle.get_text()
    assert box.x0 >= 0 and box.x1 <= width
