"""figures.context: chapter 10's ring steps, work per rank and traffic against length."""

import pytest

from trainscale import figures
from trainscale.context import attention_blocks_per_rank, ring_schedule


def test_ring_steps_draw_one_cell_per_rank_and_step():
    fig = figures.ring_attention_steps(ring_schedule(3, "zigzag"), "t", "s")
    cells = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("K/V")]
    assert len(cells) == 9
    totals = [t.get_text() for t in fig.axes[0].texts if not t.get_text().startswith("K/V")]
    assert totals == ["2", "2", "2"]  # (3 + 1) / 2 blocks on every rank


def test_ring_steps_reject_unknown_shares_and_empty_sources():
    with pytest.raises(ValueError, match="schedule"):
        figures.ring_attention_steps([[(0, 0.25)]], "t", "s")
    with pytest.raises(ValueError, match="source"):
        figures.ring_attention_steps(ring_schedule(2), "t", " ")


def test_work_per_rank_draws_one_bar_per_rank_and_layout():
    work = {layout: attention_blocks_per_rank(4, layout) for layout in ("contiguous", "zigzag")}
    fig = figures.attention_work_per_rank(work, "t", "s", note="n")
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [1.0, 2.0, 3.0, 4.0] + [2.5] * 4
    with pytest.raises(ValueError, match="work"):
        figures.attention_work_per_rank({"striped": [1.0]}, "t", "s")


def test_traffic_draws_each_scheme_in_both_panels():
    lengths = [1024, 2048]
    fig = figures.context_traffic_against_sequence(
        lengths,
        {"ring attention": [1.0, 2.0], "tensor parallelism": [3.0, 6.0]},
        {"ring attention": [2.0, 1.0], "tensor parallelism": [0.5, 0.5]},
        "t",
        "s",
    )
    assert [len(ax.get_lines()) for ax in fig.axes] == [2, 3]  # the right panel's break-even line
    with pytest.raises(ValueError, match="bytes_sent"):
        figures.context_traffic_against_sequence(lengths, {"ring attention": [1.0]}, {}, "t", "s")


def test_ring_steps_title_fits_inside_the_figure():
    # Chapter 10's longest title was clipped at the left when it sat over the grid alone.
    title = "Causal ring attention on 4 ranks, contiguous split"
    fig = figures.ring_attention_steps(ring_schedule(4), title, "s")
    box = fig._suptitle.get_window_extent(fig._get_renderer())
    assert fig._suptitle.get_text() == title
    assert box.x0 >= 0 and box.x1 <= fig.bbox.x1
