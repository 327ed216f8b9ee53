"""widgets: sliders that switch between precomputed SVG figures without a kernel."""

import ipywidgets as widgets
import matplotlib.pyplot as plt
import pytest
from ipywidgets.widgets.widget import _instances
from ipywidgets.widgets.widget_link import Link

from trainscale.widgets import MAX_FIGURES, figure_to_svg, slider, two_sliders


def _figure(value):
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, value])
    return fig


def test_svg_is_labelled_and_byte_identical_between_runs():
    first = figure_to_svg(_figure(1), alt='line to "1"')
    second = figure_to_svg(_figure(1), alt='line to "1"')
    assert first == second
    assert first.startswith('<svg role="img" aria-label="line to &quot;1&quot;"')
    assert "<text" in first  # text stays text (svg.fonttype none)
    assert plt.get_fignums() == []  # every figure closed


def test_svg_needs_alt_text():
    with pytest.raises(ValueError, match="alt"):
        figure_to_svg(_figure(1), alt=" ")


def _links() -> list[Link]:
    """Every live jslink (links are widgets of their own, outside the VBox)."""
    return [w for w in _instances.values() if isinstance(w, Link)]


def test_slider_links_index_to_stack_in_the_browser():
    box = slider([1, 2, 3], _figure, description="height", value=2, alt=lambda v: f"line to {v}")
    control, stack = box.children
    assert isinstance(stack, widgets.Stack) and len(stack.children) == 3
    assert control.index == stack.selected_index == 1
    link = next(x for x in _links() if x.source[0] is control)
    assert link.source[1] == "index" and link.target == (stack, "selected_index")
    assert "line to 2" in stack.children[1].value


def test_two_sliders_nest_stacks():
    box = two_sliders(
        [1, 2],
        [3, 4, 5],
        lambda a, b: _figure(a * b),
        descriptions=("a", "b"),
        value=(2, 5),
        alt=lambda a, b: f"{a}x{b}",
    )
    _, _, grid = box.children
    assert grid.selected_index == 1 and all(s.selected_index == 2 for s in grid.children)
    assert "2x5" in grid.children[1].children[2].value


def test_slider_rejects_bad_positions():
    with pytest.raises(ValueError, match="value"):
        slider([1, 2], _figure, description="x", value=3, alt=str)
    with pytest.raises(ValueError, match="values"):
        slider([], _figure, description="x", value=3, alt=str)
    with pytest.raises(ValueError, match="at most"):
        slider(list(range(MAX_FIGURES + 1)), _figure, description="x", value=0, alt=str)
