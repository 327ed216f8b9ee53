"""figures.compute: chapter 14's FLOP breakdown, attention share and cost table."""

from trainscale import figures
from trainscale.figures.style import svg_text


def test_flop_breakdown_stacks_the_parts_next_to_the_count():
    fig = figures.flop_breakdown({"a": 2e9, "b": 1e9}, 3e9, "flops")
    widths = [round(p.get_width(), 6) for p in fig.axes[0].patches]
    assert widths == [2.0, 1.0, 3.0]  # GFLOP: two parts, then the counted bar


def test_attention_share_plots_percentages():
    fig = figures.attention_share([1024, 2048], {"w": [0.1, 0.2]}, "share")
    assert list(fig.axes[0].lines[0].get_ydata()) == [10.0, 20.0]


def test_budget_table_shows_the_cells_it_is_given():
    fig = figures.budget_table(("a", "b"), [("1", "2")], "table", note="assumed")
    cells = fig.axes[0].tables[0].get_celld().values()
    assert sorted(cell.get_text().get_text() for cell in cells) == ["1", "2", "a", "b"]
    assert [t.get_text() for t in fig.texts] == ["assumed"]
    again = figures.budget_table(("a", "b"), [("1", "2")], "table", note="assumed")
    assert svg_text(fig) == svg_text(again)
