"""figures.planner: chapter 13's best layouts and why the others fail, for the 70B example."""

import pytest

from trainscale import planner as P
from trainscale.figures import BookFigure, planner_rejections, planner_top_layouts

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
