"""figures.step: chapter 1's timeline of a training step and bars of counted FLOPs."""

import matplotlib.pyplot as plt
import pytest

from trainscale import figures
from trainscale.compute import step_timeline
from trainscale.figures.style import PHASE_COLOURS, svg_text


@pytest.fixture
def no_pyplot_figures():
    """Book figures live outside pyplot's registry: drawing one leaves no figure open."""
    plt.close("all")
    yield
    assert plt.get_fignums() == []


def test_step_timeline_draws_every_phase_once_for_all_gpus(no_pyplot_figures):
    # forward 0-1 s, backward 1-3 s, all-reduce 2.5-3.5 s (half hidden), optimiser 3.5-4 s.
    phases = step_timeline(1.0, 2.0, 1.0, 0.5, 0.5)
    fig = figures.step_timeline(phases, gpus=2)
    ax = fig.axes[0]
    assert ax.get_title() == "One training step on 2 GPUs: 4.00 s"
    # Every GPU runs the same phases: one row stands for both.
    assert [t.get_text() for t in ax.get_yticklabels()] == ["each of\n2 GPUs"]
    assert len(ax.patches) == 4
    assert [(p.get_x(), p.get_width()) for p in ax.patches[:4]] == [
        (0.0, 1.0),
        (1.0, 2.0),
        (2.5, 1.0),
        (3.5, 0.5),
    ]
    assert ax.get_xlabel() == "time within one step (s)"
    svg_text(fig)


def test_step_timeline_on_one_gpu_and_with_a_title(no_pyplot_figures):
    phases = step_timeline(1.0, 2.0, 0.0, 0.5, 0.0)
    alone = figures.step_timeline(phases, 1).axes[0]
    assert alone.get_title() == "One training step on 1 GPU: 3.50 s"
    assert [t.get_text() for t in alone.get_yticklabels()] == ["the GPU"]
    assert len(alone.patches) == 3  # nothing to all-reduce
    assert figures.step_timeline(phases, 1, title="mine").axes[0].get_title() == "mine"
    with pytest.raises(ValueError, match="gpus"):
        figures.step_timeline(phases, 0)


def test_flop_bars_are_in_mflop_and_coloured_by_phase(no_pyplot_figures):
    counts = {"forward: matmul": 2e6, "backward: weight gradient": 4e6}
    fig = figures.flop_bars(counts, "one layer")
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == [2.0, 4.0]
    colours = [plt.matplotlib.colors.to_rgba(PHASE_COLOURS[k]) for k in ("forward", "backward")]
    assert [p.get_facecolor() for p in ax.patches] == colours
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "forward:\nmatmul",
        "backward:\nweight gradient",
    ]
    assert ax.get_ylabel() == "MFLOP (counted)"
    assert ax.get_title() == "one layer"
    svg_text(fig)
