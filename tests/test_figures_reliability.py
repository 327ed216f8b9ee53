"""figures.reliability: chapter 16's checkpoint-interval trade-off and simulated run."""

import matplotlib.pyplot as plt
import pytest

from trainscale import figures
from trainscale.figures.style import svg_text
from trainscale.reliability import LOST_TIME_PARTS

INTERVALS = [60.0, 600.0, 6_000.0]  # 1, 10 and 100 minutes
SOURCE = "failure rate: a test"


@pytest.fixture
def no_pyplot_figures():
    """Book figures live outside pyplot's registry: drawing one leaves no figure open."""
    plt.close("all")
    yield
    assert plt.get_fignums() == []


def test_tradeoff_draws_each_cause_dashed_the_total_solid_and_the_best_point(no_pyplot_figures):
    shares = {"checkpoint saves": [0.1, 0.01, 0.001], "recomputed work": [0.002, 0.02, 0.2]}
    exact = [0.1, 0.03, 0.2]
    fig = figures.checkpoint_tradeoff(
        INTERVALS, shares, exact, (600.0, 0.03), title="trade-off", source=SOURCE
    )
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    assert lines["checkpoint saves (first order)"].get_linestyle() == "--"
    assert list(lines["recomputed work (first order)"].get_ydata()) == pytest.approx([0.2, 2, 20])
    assert list(lines["total, exact"].get_xdata()) == pytest.approx([1, 10, 100])  # minutes
    assert lines["total, exact"].get_linestyle() == "-"
    assert "restarts (first order)" not in lines  # a cause left out is not drawn
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert ax.get_ylim()[1] == 100
    assert ax.get_title(loc="left") == "trade-off"
    assert "best: every 10 min,\n3 % lost" in [t.get_text() for t in ax.texts]
    assert fig._supxlabel.get_text() == SOURCE
    svg_text(fig)


def test_simulated_intervals_draw_dots_a_line_and_young(no_pyplot_figures):
    fig = figures.simulated_intervals(
        INTERVALS, [0.05, 0.02, 0.06], [0.05, 0.021, 0.058], 540.0, title="sim", source=SOURCE
    )
    ax = fig.axes[0]
    dots = next(line for line in ax.lines if line.get_marker() == "o")
    assert list(dots.get_ydata()) == pytest.approx([5, 2, 6])
    young = next(line for line in ax.lines if line.get_linestyle() == "--")
    assert list(young.get_xdata()) == [9.0, 9.0]  # 540 s = 9 min
    assert young.get_label() == "$\\sqrt{2CM}$ = 9.0 min"
    svg_text(fig)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (
            lambda: figures.checkpoint_tradeoff([60.0], {}, [0.1], (60, 0.1), title="", source="s"),
            "intervals",
        ),
        (
            lambda: figures.checkpoint_tradeoff(
                INTERVALS, {"saves": [1, 1, 1]}, [1, 1, 1], (60, 0.1), title="", source="s"
            ),
            "shares",
        ),
        (
            lambda: figures.checkpoint_tradeoff(
                INTERVALS, {}, [0.1, 0.1], (60, 0.1), title="", source="s"
            ),
            "exact",
        ),
        (
            lambda: figures.checkpoint_tradeoff(
                INTERVALS, {}, [0.1] * 3, (60, 0.1), title="", source=" "
            ),
            "source",
        ),
        (
            lambda: figures.simulated_intervals(
                INTERVALS, [0.1] * 3, [0.1] * 3, 0.0, title="", source="s"
            ),
            "young",
        ),
        (
            lambda: figures.simulated_intervals(
                INTERVALS, [0.1] * 2, [0.1] * 3, 60.0, title="", source="s"
            ),
            "simulated",
        ),
    ],
)
def test_bad_inputs_are_refused_by_name(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_every_cause_has_a_colour():
    assert set(figures.reliability.LOST_COLOURS) == set(LOST_TIME_PARTS)
