"""figures.pipeline: chapter 9's pipeline timelines and bubble curves."""

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from trainscale.figures import bubble_curves, pipeline_timelines, schedule_comparison, svg_text
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


def test_zero_bubble_timelines_draw_both_halves_of_the_backward():
    fig = pipeline_timelines(
        [simulate("1f1b", 4, 8), simulate("zb-h1", 4, 8), simulate("zb-v", 4, 8)]
    )
    labels = [text.get_text() for text in fig.legends[0].get_texts()]
    assert labels == [
        "forward",
        "backward",
        "input gradient (B)",
        "weight gradient (W)",
        "forward, 2nd chunk",
        "B, 2nd chunk",
        "W, 2nd chunk",
        "idle (bubble)",
    ]
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles[1] == "ZB-H1, 4 stages, 8 micro-batches: bubble 11%, at most 4 held"
    assert titles[2].startswith("ZB-V, 4 stages, 8 micro-batches: bubble 6%")  # 1.5 of 25.5
    plain = pipeline_timelines([simulate("gpipe", 2, 2)])
    assert [t.get_text() for t in plain.legends[0].get_texts()] == [
        "forward",
        "backward",
        "idle (bubble)",
    ]


def test_schedule_comparison_draws_one_bar_per_schedule_in_each_panel():
    timelines = [simulate("1f1b", 4, 8), simulate("zb-h1", 4, 8), simulate("zb-v", 4, 8)]
    fig = schedule_comparison(timelines, source="simulated")
    bubbles, held = fig.axes
    assert [bar.get_width() for bar in bubbles.patches] == pytest.approx(
        [100 * 9 / 33, 100 * 3 / 27, 100 * 1.5 / 25.5]
    )
    assert [bar.get_width() for bar in held.patches] == [4, 4, 4]
    assert [t.get_text() for t in bubbles.get_yticklabels()] == ["1F1B", "ZB-H1", "ZB-V"]
    assert svg_text(fig) == svg_text(schedule_comparison(timelines, source="simulated"))
    with pytest.raises(ValueError, match="source"):
        schedule_comparison(timelines, source=" ")
    with pytest.raises(ValueError, match="timelines"):
        schedule_comparison([], source="simulated")


def test_schedule_comparison_keeps_every_label_inside_the_figure():
    # the right panel's axis label ran off the figure's right edge (issue #25)
    timelines = [simulate("1f1b", 4, 8), simulate("interleaved", 4, 8, chunks=2)]
    timelines += [simulate("zb-h1", 4, 8), simulate("zb-v", 4, 8)]
    fig = schedule_comparison(timelines, source="Simulated with trainscale.pipeline.simulate")
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    box = fig.bbox
    texts = [ax.xaxis.label for ax in fig.axes] + [fig._supxlabel, fig._suptitle]
    for text in texts:
        extent = text.get_window_extent(renderer)
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1, text.get_text()
        assert box.y0 <= extent.y0 and extent.y1 <= box.y1, text.get_text()
