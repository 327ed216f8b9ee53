"""figures.pipeline: chapter 07's pipeline timelines and bubble curves."""

import pytest

from trainscale.figures import bubble_curves, pipeline_timelines, svg_text
from trainscale.pipeline import bubble, simulate


def test_timeline_figure_has_one_panel_per_timeline_and_is_reproducible():
    timelines = [simulate("gpipe", 4, 4), simulate("1f1b", 4, 4)]
    fig = pipeline_timelines(timelines)
    assert len(fig.axes) == 2
    assert "bubble 43%" in fig.axes[0].get_title(loc="left")
    assert svg_text(fig) == svg_text(pipeline_timelines(timelines))
    interleaved = pipeline_timelines([simulate("interleaved", 2, 4, chunks=2)], end=40)
    assert interleaved.axes[0].get_xlim()[1] == pytest.approx(40.4)
    with pytest.raises(ValueError, match="titles"):
        pipeline_timelines(timelines, titles=["one"])
    with pytest.raises(ValueError, match="timelines"):
        pipeline_timelines([])


def test_bubble_curves_draw_every_curve_and_mark():
    curves = {k: ([1, 2, 4], [bubble(k, m) for m in (1, 2, 4)]) for k in (2, 4)}
    fig = bubble_curves(curves, marks={2: (8, bubble(2, 8))}, threshold=0.2)
    assert len(fig.axes[0].lines) == 4  # two curves, one mark, the threshold
