"""figures.hardware: the node, a GEMM's tiles in waves, the roofline and a GEMM's share."""

import pytest

from trainscale import figures
from trainscale.figures import BookFigure, svg_text


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]


def test_the_node_labels_each_link_with_its_speed():
    fig = figures.node_diagram("H100-80GB", 8, 450e9, 50e9, 3.35e12, source="datasheet")
    assert isinstance(fig, BookFigure)
    text = " ".join(_texts(fig))
    assert "450 GB/s each way per GPU" in text
    assert "50 GB/s each way per GPU (400 Gb/s)" in text  # 50e9 B/s x 8 bits
    assert "3.35 TB/s" in text and "datasheet" in text
    assert sum(t.startswith("GPU\n") for t in _texts(fig)) == 8
    with pytest.raises(ValueError, match="gpus"):
        figures.node_diagram("H100-80GB", 0, 1, 1, 1, source="s")
    with pytest.raises(ValueError, match="source"):
        figures.node_diagram("H100-80GB", 8, 1, 1, 1, source=" ")


def test_the_waves_legend_counts_tiles_and_idle_sms():
    # 9 x 18 = 162 tiles on 132 SMs: a full wave, then 30 tiles with 102 SMs idle.
    fig = figures.gemm_tile_waves(9, 18, 132, "2,304 squared", source="model")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["wave 1: 132 tiles on 132 SMs", "wave 2: 30 tiles on 132 SMs, 102 idle"]
    assert len(fig.axes[0].patches) == 162
    with pytest.raises(ValueError, match="multiprocessors"):
        figures.gemm_tile_waves(1, 1, 0, "t", source="s")


def test_the_roofline_bends_at_the_balance_and_is_stable():
    roofs = {"H100": (989e12, 3.35e12)}
    points = {"add": (1 / 6, 3.35e12 / 6), "GEMM": (2730.0, 989e12)}
    fig = figures.roofline(roofs, points, "rooflines", source="datasheets")
    line = fig.axes[0].get_lines()[0]
    xs, ys = line.get_data()
    assert xs[1] == pytest.approx(989 / 3.35) and ys[1] == pytest.approx(989)  # TFLOP/s
    assert "H100: balance 295 FLOP/B" in [t.get_text() for t in fig.axes[0].get_legend().texts]
    again = figures.roofline(roofs, points, "rooflines", source="datasheets")
    assert svg_text(fig) == svg_text(again)
    with pytest.raises(ValueError, match="roofs"):
        figures.roofline({}, points, "none", source="s")


def test_the_share_curve_draws_percent_and_the_fastest_measured():
    fig = figures.gemm_share_against_size(
        [256, 512, 1024], [0.01, 0.2, 0.5], 0.8, "shares", source="model"
    )
    curve, peak, fastest = fig.axes[0].get_lines()
    assert list(peak.get_ydata()) == pytest.approx([100, 100])
    assert list(curve.get_ydata()) == pytest.approx([1, 20, 50])
    assert list(fastest.get_ydata()) == pytest.approx([80, 80])
    assert "fastest GEMM measured: 80%" in _texts(fig)
    unmeasured = figures.gemm_share_against_size([256], [0.1], None, "t", source="s")
    assert len(unmeasured.axes[0].get_lines()) == 2  # the curve and the datasheet peak
    with pytest.raises(ValueError, match="same length"):
        figures.gemm_share_against_size([256, 512], [0.1], None, "t", source="s")
