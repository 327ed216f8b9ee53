"""figures.mesh: chapter 17's device mesh, its groups read back from the drawing."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib.patches import Rectangle

from trainscale import figures
from trainscale.figures import BookFigure, svg_text
from trainscale.workers.mesh_exercise import array_groups, reference_groups

LAYOUTS = [
    ((2, 1, 2, 1, 2), 0),  # the chapter's TP 2 x PP 2 x DP 2
    ((1, 2, 2, 2, 1), 5),  # HSDP 2 x 2 with CP 2: a DP group that skips ranks
    ((2, 1, 1, 2, 2), 3),  # PP 2 x CP 2 x TP 2
    ((4, 1, 2, 1, 8), 42),  # chapter 17's Problem 2: the 70B on 64 GPUs
]


def _boxes(fig, prefix: str) -> dict[int, Rectangle]:
    """The rectangles whose gid is ``prefix-<rank>``, by rank."""
    found = {}
    for patch in fig.axes[0].patches:
        gid = patch.get_gid() or ""
        if gid.startswith(prefix + "-"):
            found[int(gid.rsplit("-", 1)[1])] = patch
    return found


def _centre(patch: Rectangle) -> tuple[float, float]:
    return (patch.get_x() + patch.get_width() / 2, patch.get_y() + patch.get_height() / 2)


def _drawn_groups(fig) -> dict[str, list[int]]:
    """Each outlined group, read back from the drawing: the rank whose box each outline
    surrounds (the same centre), and the rank number written in that box."""
    ranks = _boxes(fig, "rank")
    labels = {
        (round(t.get_position()[0], 6), round(t.get_position()[1], 6)): t.get_text()
        for t in fig.axes[0].texts
    }
    groups = {}
    for name in ("tp", "cp", "dp", "pp"):
        members = []
        for ring in _boxes(fig, name).values():
            inside = [r for r, box in ranks.items() if _centre(box) == pytest.approx(_centre(ring))]
            assert len(inside) == 1
            x, y = _centre(ring)
            members.append(int(labels[(round(x, 6), round(y, 6))]))  # the number drawn
        if members:
            groups[name] = sorted(members)
    return groups


@pytest.mark.parametrize(("sizes", "rank"), LAYOUTS)
def test_the_outlined_groups_are_the_reference_groups(sizes, rank):
    fig = figures.device_mesh(sizes, rank)
    assert isinstance(fig, BookFigure)
    assert len(_boxes(fig, "rank")) == math.prod(sizes)  # every rank drawn once
    drawn = _drawn_groups(fig)
    want = reference_groups(list(sizes), rank)
    independent = array_groups(sizes, rank)  # arange(world).view(sizes), not the figure's
    for name in ("tp", "dp", "pp"):
        assert drawn[name] == sorted(want[name]) == sorted(independent[name])
    assert drawn.get("cp", [rank]) == sorted(want["cp"])  # cp outlined only when > 1 rank


def test_the_chapters_layout_by_hand():
    # TP 2 x PP 2 x DP 2, ranks row-major over (pp, dp_shard, tp): rank 0 at (0, 0, 0).
    # TP partner: tp = 1 -> rank 1; DP partner: dp_shard = 1 -> rank 0 + 2; PP: pp = 1 -> 4.
    fig = figures.device_mesh((2, 1, 2, 1, 2), 0)
    assert _drawn_groups(fig) == {"tp": [0, 1], "dp": [0, 2], "pp": [0, 4]}
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == [
        "rank 0's TP group: 0, 1",
        "rank 0's DP group: 0, 2",
        "rank 0's PP group: 0, 4",
    ]
    ranks = _boxes(fig, "rank")
    # TP partners sit side by side in one row; PP partners in one column, one stage down.
    assert ranks[0].get_y() == ranks[1].get_y() and ranks[1].get_x() == ranks[0].get_x() + 1
    assert ranks[4].get_x() == ranks[0].get_x() and ranks[4].get_y() > ranks[0].get_y()


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.integers(1, 3), min_size=5, max_size=5).filter(lambda s: math.prod(s) <= 64),
    st.integers(0, 63),
)
def test_any_small_mesh_draws_its_groups(sizes, rank):
    rank %= math.prod(sizes)
    drawn = _drawn_groups(figures.device_mesh(sizes, rank))
    want = array_groups(sizes, rank)
    assert {name: drawn[name] for name in ("tp", "dp", "pp")} == {
        name: sorted(want[name]) for name in ("tp", "dp", "pp")
    }


def test_two_renders_are_the_same_svg():
    first = svg_text(figures.device_mesh((2, 1, 2, 1, 2), 0))
    assert first == svg_text(figures.device_mesh((2, 1, 2, 1, 2), 0))
    assert "Groups:" in first  # the source line


@pytest.mark.parametrize(
    ("sizes", "rank", "named"),
    [
        ((2, 1, 2, 2), 0, "sizes"),  # four sizes for five dimensions
        ("22122", 0, "sizes"),
        ((2, 1, 0, 1, 2), 0, "dp_shard"),
        ((2, 1, 2.5, 1, 2), 0, "dp_shard"),
        ((4, 2, 2, 2, 4), 0, "sizes"),  # 128 ranks: more than the figure draws
        ((2, 1, 2, 1, 2), 8, "highlight_rank"),
        ((2, 1, 2, 1, 2), -1, "highlight_rank"),
        ((2, 1, 2, 1, 2), True, "highlight_rank"),
    ],
)
def test_bad_arguments_name_themselves(sizes, rank, named):
    with pytest.raises(ValueError, match=named):
        figures.device_mesh(sizes, rank)


def test_a_blank_source_is_refused():
    with pytest.raises(ValueError, match="source"):
        figures.device_mesh((2, 1, 2, 1, 2), 0, source="  ")
