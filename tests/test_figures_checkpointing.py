"""figures.checkpointing: chapter 3's saved activations over a step and one layer's bytes."""

import matplotlib.pyplot as plt
import pytest

from trainscale import figures
from trainscale.checkpointing import memory_timeline
from trainscale.figures.style import svg_text

MIB = 2**20


@pytest.fixture
def no_pyplot_figures():
    """Book figures live outside pyplot's registry: drawing one leaves no figure open."""
    plt.close("all")
    yield
    assert plt.get_fignums() == []


def test_memory_timelines_draw_one_line_and_one_peak_per_run(no_pyplot_figures):
    # 4 blocks keeping 4 MiB each: the plain step peaks at 16 MiB after the last forward.
    plain = memory_timeline(4, None, MIB, 4 * MIB)
    halved = [(0.0, 0), (2.0, 8 * MIB), (6.0, 0)]
    fig = figures.memory_timelines({"plain": plain, "checkpointed": halved}, "step", top_mib=20)
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.lines if not line.get_label().startswith("_")]
    assert labels == ["plain: peak 16.00 MiB", "checkpointed: peak 8.00 MiB"]
    peaks = [line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == ":"]
    assert peaks == [16.0, 8.0]
    assert ax.lines[0].get_linestyle() == "--"  # the reference run, dashed
    assert ax.get_ylim() == (0.0, 20.0)
    assert ax.get_title() == "step"
    assert ax.get_ylabel() == "saved activations (MiB)"
    svg_text(fig)


def test_layer_bytes_draw_measured_bars_and_estimate_lines(no_pyplot_figures):
    measured = {"plain": 6 * MIB, "selective": 3 * MIB}
    fig = figures.layer_bytes(measured, {"34 sbh": 5 * MIB, "sbh": MIB}, "one layer")
    ax = fig.axes[0]
    assert [p.get_width() for p in ax.patches] == [6.0, 3.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["plain", "selective"]
    assert [line.get_label() for line in ax.lines] == ["34 sbh: 5.00", "sbh: 1.00"]
    assert ax.get_xlim() == pytest.approx((0.0, 6.0 * 1.15))
    assert ax.get_title() == "one layer"
    svg_text(fig)


def test_recompute_slowdown_draws_measured_points_and_counted_lines(no_pyplot_figures):
    references = {"FLOPs, counted: 63/47": 63 / 47, "operator calls, counted: 5/3": 5 / 3}
    fig = figures.recompute_slowdown(
        [16, 64, 256], [2.5, 1.8, 1.4], references, "slowdown", "width", "measured on a CPU"
    )
    ax = fig.axes[0]
    measured = ax.lines[0]
    assert list(measured.get_xdata()) == [16, 64, 256]
    assert list(measured.get_ydata()) == [2.5, 1.8, 1.4]
    assert "(measured)" in measured.get_label()
    assert [line.get_label() for line in ax.lines[1:]] == list(references)
    assert [line.get_ydata()[0] for line in ax.lines[1:]] == list(references.values())
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16", "64", "256"]
    assert ax.get_ylim() == pytest.approx((1.0, 2.5 * 1.08))
    assert fig._supxlabel.get_text() == "measured on a CPU"
    svg_text(fig)


def test_recompute_slowdown_needs_one_slowdown_per_size():
    with pytest.raises(ValueError, match="sizes and slowdowns"):
        figures.recompute_slowdown([16, 32], [1.5], {}, "t", "x", "n")
