"""figures.planner: chapter 16's best layouts and why the others fail, for the 70B example."""

import pytest

from trainscale import planner as P
from trainscale.figures import (
    BookFigure,
    planner_calibration,
    planner_rejections,
    planner_top_layouts,
)

H100 = P.EXAMPLE_CLUSTER


@pytest.fixture(scope="module")
def layouts_70b():
    return P.plan(P.EXAMPLE_MODEL, H100, P.EXAMPLE_GLOBAL_BATCH)


def test_figures_draw_the_plan(layouts_70b):
    before = [lay.step_seconds for lay in layouts_70b]
    top = planner_top_layouts(P.top_layouts(layouts_70b, 4), H100.memory_bytes)
    rejected = planner_rejections(layouts_70b, H100.memory_bytes)
    assert isinstance(top, BookFigure) and len(top.axes) == 2
    assert isinstance(rejected, BookFigure) and len(rejected.axes) == 1
    assert "invalid" in rejected.axes[0].get_title()
    assert [lay.step_seconds for lay in layouts_70b] == before
    with pytest.raises(ValueError, match="layouts"):
        planner_top_layouts([], H100.memory_bytes)


def test_calibration_figure_draws_one_range_per_run():
    fig = planner_calibration(
        [0.30, 0.40, 0.50],
        [(0.25, 0.3, 0.35), (0.3, 0.35, 0.4), (0.5, 0.55, 0.6)],
        ["a", "a", "b"],
        source="Sources: a; b.",
    )
    assert isinstance(fig, BookFigure) and len(fig.axes) == 1
    assert len(fig.axes[0].collections) == 2  # one set of range bars per source
    # the source sits in the layout, under the x-label, not over it
    assert fig.get_supxlabel() == "Sources: a; b."
    with pytest.raises(ValueError, match="published"):
        planner_calibration([0.3], [], ["a"], source="a")
    with pytest.raises(ValueError, match="source"):
        planner_calibration([0.3], [(0.2, 0.3, 0.4)], ["a"], source=" ")


def test_a_part_is_drawn_and_named_only_where_some_bar_shows_it(layouts_70b):
    no_cp = [lay for lay in layouts_70b if lay.cp == 1]
    best = P.top_layouts(no_cp, 2)
    dense = planner_top_layouts(best, H100.memory_bytes)
    labels = [text.get_text() for text in dense.legends[0].get_texts()]
    # Neither layout recomputes, and the optimiser step is 0.03 % of each step (under
    # half a per cent): neither is named; pipeline sends, at 0.16 % and 0.32 %, are not
    # either. Compute, TP and DP traffic and the bubble are.
    assert all(lay.recompute == "none" for lay in best)
    assert labels == [
        "compute",
        "tensor-parallel traffic",
        "data-parallel traffic",
        "pipeline bubble",
    ]
    long = P.LONG_CONTEXT_MODEL
    cluster = P.Cluster(nodes=2, **P.H100_NODE)
    split = P.evaluate(long, cluster, 8, 8, 1, 1, 1, "none", context_parallel=2)
    shown = planner_top_layouts([split], cluster.memory_bytes).legends[0].get_texts()
    assert "context-parallel traffic" in [text.get_text() for text in shown]
    assert "expert-parallel traffic" not in [text.get_text() for text in shown]
