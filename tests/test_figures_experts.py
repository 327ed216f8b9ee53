"""figures.experts: chapter 11's tokens per expert and all-to-all matrix."""

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex

from trainscale import figures
from trainscale.figures.experts import DROPPED_COLOUR
from trainscale.figures.style import PALE_GREY, svg_text

SOURCE = "Source: a test"


@pytest.fixture
def no_pyplot_figures():
    """Book figures live outside pyplot's registry: drawing one leaves no figure open."""
    plt.close("all")
    yield
    assert plt.get_fignums() == []


def _bars(ax):
    return [(p.get_x() + p.get_width() / 2, p.get_y(), p.get_height()) for p in ax.patches]


def test_loads_side_by_side_with_an_even_line(no_pyplot_figures):
    fig = figures.expert_loads(
        {"before": [6, 0, 2], "after": [3, 3, 2]}, title="loads", source=SOURCE, even=8 / 3
    )
    ax = fig.axes[0]
    heights = [round(h) for _, _, h in _bars(ax)]
    assert heights == [6, 0, 2, 3, 3, 2]  # one series after the other
    assert ax.get_title(loc="left") == "loads"
    assert len(ax.texts) == 0
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["before", "after", "even share (2.66667)"]
    assert fig._supxlabel.get_text() == SOURCE
    svg_text(fig)


def test_capacity_cuts_each_bar_and_hatches_what_is_dropped(no_pyplot_figures):
    fig = figures.expert_loads({"offered": [6, 1, 4]}, title="c", source=SOURCE, capacity=4, top=10)
    ax = fig.axes[0]
    bars = _bars(ax)
    kept, over = bars[:3], bars[3:]
    assert [h for _, _, h in kept] == [4, 1, 4]
    assert [(y, h) for _, y, h in over] == [(4, 2), (1, 0), (4, 0)]  # 2 dropped on expert 0
    assert all(to_hex(p.get_edgecolor()) == DROPPED_COLOUR.lower() for p in ax.patches[3:])
    assert ax.get_ylim() == (0, 10)
    assert "capacity 4" in [t.get_text() for t in ax.texts]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["offered", "dropped"]
    svg_text(fig)


def test_matrix_labels_every_cell_and_greys_the_diagonal(no_pyplot_figures):
    matrix = [[10, 1_536, 0], [512, 20, 256], [0, 1_024, 30]]
    fig = figures.all_to_all_matrix(matrix, title="bytes", source=SOURCE)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts] == [
        "10", "1,536", "0", "512", "20", "256", "0", "1,024", "30",
    ]  # fmt: skip
    cells = ax.patches
    assert to_hex(cells[0].get_facecolor()) == PALE_GREY  # rank 0 to itself
    assert to_hex(cells[1].get_facecolor()) == to_hex(figures.PALETTE["blue"])  # the largest
    assert to_hex(cells[2].get_facecolor()) == "#ffffff"  # nothing sent
    assert [label.get_text() for label in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    svg_text(fig)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: figures.expert_loads({}, title="t", source="s"), "loads"),
        (lambda: figures.expert_loads({"a": [1], "b": [1, 2]}, title="t", source="s"), "loads"),
        (lambda: figures.expert_loads({"a": [-1]}, title="t", source="s"), "loads"),
        (lambda: figures.expert_loads({"a": [1]}, title="t", source=" "), "source"),
        (lambda: figures.all_to_all_matrix([[1, 2]], title="t", source="s"), "square"),
        (lambda: figures.all_to_all_matrix([[-1]], title="t", source="s"), "matrix"),
    ],
)
def test_bad_arguments_are_refused(call, match, no_pyplot_figures):
    with pytest.raises(ValueError, match=match):
        call()
